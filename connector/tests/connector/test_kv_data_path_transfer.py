"""KV over each data path (device, pinned-host) between two processes, with CPU tensors, through the
real transports: it lands, a corrupted payload fails, peers on paths or checksum algorithms that
disagree are refused by name, and decode waits for its kernels before it reports a load.

A CPU cache forced onto the `device` path runs the device code: staging on the cache's device, the
device checksum (device_checksum) for zero-copy spans, readiness marks before each write; forced
onto `pinned-host` it runs the fallback: encode into a scratch on the cache's device, copy to host
staging per part, and back per piece at decode (synchronous copies here, a side stream on CUDA).
Decode runs in this process, prefill in kv_peer.py's, over Mooncake (TCP) and a gloo pair group.
The blocks and the decode side are data_path_cases.py's.
"""

from __future__ import annotations

import pytest
import torch
from data_path_cases import DST_BLOCKS, RELATIVE_ERROR, SRC_BLOCKS, decode, relative_error
from kv_peer import GEOMETRY, NUM_BLOCKS, Prefill, assert_a_corrupted_payload_fails_on_both_sides, make_caches

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import chunk_ranges
from dllm_connector.pipe.device_copy import Copies, Ready
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.base import Transport
from dllm_connector.transport.placement import DataPath, PathSetting
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

PATHS = [PathSetting.DEVICE, PathSetting.PINNED_HOST]

PIECES = {"whole batches": {}, "layer pieces": {"piece_bytes": 1}}


@pytest.mark.parametrize("pieces", PIECES.values(), ids=PIECES.keys())
@pytest.mark.parametrize("compression", [Compression.NONE, Compression.FP8])
@pytest.mark.parametrize("path", PATHS)
def test_kv_arrives_on_each_data_path(
    transport: Transport,
    prefill: Prefill,
    path: PathSetting,
    compression: Compression,
    pieces: dict[str, int],
) -> None:
    receiver, kv = decode(transport, path)
    try:
        assert receiver.placement.path is DataPath(path.value)
        receiver.expect("t-path", DST_BLOCKS, prompt_hash=prompt_hash([5]))
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-path", "block_ids": SRC_BLOCKS, "hash": prompt_hash([5])}],
            compression=compression.value,
            data_path=path.value,
            **pieces,
        )
        assert receiver.wait_for("t-path", timeout=60) == ""
        report = prefill.report()
        assert report[0] == {"transfer_id": "t-path", "error": None}
        assert report[-1]["data_path"] == path.value
        assert report[-1]["staging_in_use"] == 0
        assert receiver.staging.in_use == 0
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        assert relative_error(kv.gather(DST_BLOCKS), want) <= RELATIVE_ERROR[compression]
        untouched = sorted(set(range(NUM_BLOCKS)) - set(DST_BLOCKS))
        assert not bool(kv.gather(untouched).any())
    finally:
        receiver.close()


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.FP8])
@pytest.mark.parametrize("path", PATHS)
def test_a_corrupted_payload_fails_on_each_data_path(
    transport: Transport, prefill: Prefill, path: PathSetting, compression: Compression
) -> None:
    """Zero-copy on the device path: the device checksum over the blocks; staged: over the payload."""
    receiver, _ = decode(transport, path)
    try:
        assert_a_corrupted_payload_fails_on_both_sides(
            receiver,
            prefill,
            DST_BLOCKS[:40],
            SRC_BLOCKS[:40],
            compression=compression.value,
            data_path=path.value,
        )
        assert receiver.staging.in_use == 0
    finally:
        receiver.close()


@pytest.mark.parametrize("kind", ["mooncake"], indirect=True, scope="module")  # zero-copy is one-sided
def test_zero_copy_offered_to_a_cache_the_transport_does_not_hold_is_staged_instead(
    transport: Transport, prefill: Prefill
) -> None:
    """Prefill on the device path offers codec none block to block; decode on pinned-host never
    registered its cache (GPUDirect on prefill's nodes only, say), so its accept says staged and
    prefill stages the part: the KV lands exactly, through decode's staging, which is free after."""
    receiver, kv = decode(transport, PathSetting.PINNED_HOST)
    try:
        assert not receiver.placement.cache_registered
        receiver.expect("t-mixed", DST_BLOCKS[:10])
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-mixed", "block_ids": SRC_BLOCKS[:10]}],
            data_path=PathSetting.DEVICE.value,
        )
        assert receiver.wait_for("t-mixed", timeout=60) == ""
        report = prefill.report()
        assert not report[0]["error"], report
        assert report[-1]["data_path"] == DataPath.DEVICE.value
        assert report[-1]["staging_in_use"] == 0
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS[:10])
        assert torch.equal(kv.gather(DST_BLOCKS[:10]), want)
        assert receiver.staging.in_use == 0
    finally:
        receiver.close()


@pytest.mark.parametrize(("prefill_path", "decode_path"), [("host", "device"), ("pinned-host", "host")])
def test_a_peer_checksumming_with_another_algorithm_is_refused_by_name(
    transport: Transport, prefill: Prefill, prefill_path: str, decode_path: str
) -> None:
    """Host path: XXH3-64 by host cores; off it: nh64 where the payload is. The header names it."""
    receiver, _ = decode(transport, PathSetting(decode_path))
    algos = {"host": "xxh3_64", "device": "nh64", "pinned-host": "nh64"}
    try:
        receiver.expect("t-algo", DST_BLOCKS[:20])
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-algo", "block_ids": SRC_BLOCKS[:20]}],
            compression="int8",
            data_path=prefill_path,
        )
        outcome = receiver.wait_for("t-algo", timeout=60)
        assert outcome is not None
        named = f"prefill checksums the KV with {algos[prefill_path]}, decode with {algos[decode_path]}"
        assert named in outcome
        assert prefill.report()[0]["error"]
        assert receiver.staging.in_use == 0
    finally:
        receiver.close()


class CountingCopiesDouble(Copies):
    """Test double for decode's Copies (a mark waits for anything only on a CUDA device, where it
    syncs an event of the kernels queued): the real CPU copies, with each mark's wait recorded as
    whether the load was still unreported when it ran."""

    def __init__(self, receiver: KVReceiver, transfer_id: str) -> None:
        super().__init__(torch.device("cpu"))
        self._receiver, self._transfer_id = receiver, transfer_id
        self.marks = 0
        self.waits: list[bool] = []

    def mark(self) -> Ready:
        self.marks += 1
        ready = super().mark()

        def wait() -> None:
            self.waits.append(self._transfer_id in self._receiver.pending)
            ready()

        return wait


SYNC_CASES = [
    pytest.param("mooncake", PathSetting.DEVICE, Compression.NONE, id="zero-copy"),
    pytest.param("mooncake", PathSetting.DEVICE, Compression.FP8, id="one-sided staged"),
    pytest.param("mooncake", PathSetting.PINNED_HOST, Compression.FP8, id="one-sided pinned-host"),
    pytest.param("gloo", PathSetting.PINNED_HOST, Compression.FP8, id="two-sided"),
]


@pytest.mark.parametrize("double", [None, "corrupt"])
@pytest.mark.parametrize(("kind", "path", "compression"), SYNC_CASES, indirect=["kind"], scope="module")
def test_decode_waits_for_its_kernels_once_per_chunk_before_the_load_is_reported(
    transport: Transport, prefill: Prefill, path: PathSetting, compression: Compression, double: str | None
) -> None:
    """Loaded or failed, every chunk's decode and scatter work is waited for before the outcome is
    reported (one mark and one wait per chunk, all while the load is still pending)."""
    receiver, _ = decode(transport, path)
    copies = receiver.copies = CountingCopiesDouble(receiver, "t-sync")
    try:
        receiver.expect("t-sync", DST_BLOCKS)
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-sync", "block_ids": SRC_BLOCKS}],
            compression=compression.value,
            data_path=path.value,
            threshold_tokens=16 * GEOMETRY.block_size,  # chunks of 16 blocks
            **({"double": double} if double else {}),
        )
        outcome = receiver.wait_for("t-sync", timeout=60)
        prefill.report()
        assert copies.waits == [True] * copies.marks  # each wait before the load was reported
        if double is None:
            assert outcome == ""
            assert copies.marks == len(chunk_ranges(len(SRC_BLOCKS), 16))  # one per chunk
        else:  # the bad first chunk, and those read before the sender stopped
            assert outcome is not None
            assert "checksum" in outcome
            assert copies.marks >= 1
    finally:
        receiver.close()
