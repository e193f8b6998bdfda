"""KV on the device and pinned-host data paths, with CPU tensors, through the real transports.

A CPU cache forced onto the `device` path runs the device code: staging on the cache's device, the
device checksum (device_checksum) for zero-copy spans, readiness marks before each write; forced
onto `pinned-host` it runs the fallback: encode into a scratch on the cache's device, copy to host
staging per part, and back per piece at decode (synchronous copies here, a side stream on CUDA).
Decode runs in this process, prefill in kv_peer.py's, over Mooncake (TCP) and a gloo pair group.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from kv_peer import (
    GEOMETRY,
    HOST,
    LAYERS,
    NUM_BLOCKS,
    CorruptingSender,
    Prefill,
    assert_a_corrupted_payload_fails_on_both_sides,
    make_caches,
    receiver_config,
)

from dllm_connector.codec.device_checksum import RunningTensorChecksum
from dllm_connector.layout import PagedKV
from dllm_connector.pipe import chunk_encoder as encoder_module
from dllm_connector.pipe import chunk_reader as reader_module
from dllm_connector.pipe import common as common_module
from dllm_connector.pipe.common import chunk_ranges, gb
from dllm_connector.pipe.device_copy import Copies, HostMirror, Ready
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.base import Transport, TransportError
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import DataPath, PathSetting, Placement, TransportTraits
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

SRC_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))[:120]]
DST_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(4))[:120]]
RELATIVE_ERROR = {Compression.NONE: 0.0, Compression.FP8: 0.04, Compression.INT8: 0.01}
PATHS = [PathSetting.DEVICE, PathSetting.PINNED_HOST]


def decode(transport: Transport, path: PathSetting, **changes: Any) -> tuple[KVReceiver, PagedKV]:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    return KVReceiver(transport, kv, receiver_config(data_path=path, **changes), HOST, 0), kv


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


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
def test_zero_copy_into_a_cache_the_transport_does_not_hold_is_refused(
    transport: Transport, prefill: Prefill
) -> None:
    """Prefill on the device path offers codec none block to block; decode on pinned-host never
    registered its cache, so it refuses by name before anything is written."""
    receiver, kv = decode(transport, PathSetting.PINNED_HOST)
    try:
        receiver.expect("t-mixed", DST_BLOCKS[:10])
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-mixed", "block_ids": SRC_BLOCKS[:10]}],
            data_path=PathSetting.DEVICE.value,
        )
        outcome = receiver.wait_for("t-mixed", timeout=60)
        assert outcome is not None
        assert "both engines need the same data path" in outcome
        assert "both engines need the same data path" in prefill.report()[0]["error"]
        assert not bool(kv.gather(DST_BLOCKS[:10]).any())
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


def test_a_scratch_the_device_cannot_give_fails_the_send_and_releases_its_staging() -> None:
    """Pinned-host: the send's device scratch cannot be had (the GPU is out of memory; here a double
    of the scratch raises what torch raises): that send fails naming it, and its staging reservation
    is released, so later sends are not starved."""
    config = receiver_config(
        data_path=PathSetting.PINNED_HOST, compression=Compression.FP8, async_transfer=False
    )
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver = KVReceiver(decode_transport, PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config, HOST, 0)
    sender = KVSender(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)
    try:
        assert sender.scratch is not None

        def out_of_memory_double(view: torch.Tensor) -> torch.Tensor:
            raise torch.OutOfMemoryError(f"CUDA out of memory for {view.numel()} bytes (test double)")

        sender.scratch.take = out_of_memory_double  # type: ignore[method-assign]
        hashed = prompt_hash([1, 2, 3])
        receiver.expect("oom", tuple(range(100, 108)), prompt_hash=hashed)
        sender.submit(SendJob("oom", tuple(range(10, 18)), HOST, receiver.port, hashed))
        reason = sender.finished()["oom"]
        assert reason is not None
        assert "out of memory" in reason
        assert sender.staging.in_use == 0
        assert receiver.wait_for("oom", 20) != ""
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


def test_the_zero_copy_device_checksum_hashes_a_layer_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Codec none, zero-copy, device path, over Mooncake TCP: each side hashes a chunk's blocks a
    layer at a time (gathered on the cache's device), not span by span, and a flipped byte is still
    caught. The spy below is a double: it counts RunningTensorChecksum.add and runs the real one."""
    adds: list[int] = []
    real_add = RunningTensorChecksum.add

    def counting_add_spy(self: RunningTensorChecksum, data: torch.Tensor) -> None:
        adds.append(data.numel())
        real_add(self, data)

    monkeypatch.setattr(RunningTensorChecksum, "add", counting_add_spy)
    config = receiver_config(data_path=PathSetting.DEVICE, async_transfer=False)
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver, kv = decode(decode_transport, PathSetting.DEVICE, async_transfer=False)
    try:
        for sender_class, transfer in ((KVSender, "fine"), (CorruptingSender, "flipped")):
            adds.clear()
            sender = sender_class(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)
            try:
                assert sender.zero_copy
                receiver.expect(transfer, DST_BLOCKS)
                sender.submit(SendJob(transfer, tuple(SRC_BLOCKS), HOST, receiver.port))
                outcome = receiver.wait_for(transfer, 30)
                reason = sender.finished()[transfer]
            finally:
                sender.close(timeout=10)
            chunks = len(chunk_ranges(len(SRC_BLOCKS), sender._chunk_blocks(len(SRC_BLOCKS))))
            # a layer per add, not a span per add: the sender every chunk, decode those it loads (after
            # a bad one it only consumes the rest)
            hashed_by_decode = chunks if transfer == "fine" else 1
            assert len(adds) == (chunks + hashed_by_decode) * LAYERS
            assert len(adds) < len(SRC_BLOCKS)
            if transfer == "fine":
                assert (outcome, reason) == ("", None)
                want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
                assert torch.equal(kv.gather(DST_BLOCKS), want)
            else:
                assert outcome is not None
                assert "checksum" in outcome
                assert reason is not None
                assert "checksum" in reason
        assert receiver.stats.checksum_failures == 1
    finally:
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


def test_concurrent_pinned_host_transfers_share_one_scratch_bounded_by_the_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three sends at once from one prefill side, three loads at once on one decode side: every
    device scratch either side works in is a slice of its one scratch, as large as its staging
    (bufferSizeGB), at the slice's staging reservation's own offset; each transfer lands intact."""
    mirrors: list[HostMirror] = []

    class RecordingMirror(HostMirror):
        """Spy double: the real HostMirror, remembered."""

        def __init__(self, work: torch.Tensor, host: torch.Tensor, copies: Copies) -> None:
            super().__init__(work, host, copies)
            mirrors.append(self)

    monkeypatch.setattr(encoder_module, "HostMirror", RecordingMirror)
    monkeypatch.setattr(reader_module, "HostMirror", RecordingMirror)
    config = receiver_config(data_path=PathSetting.PINNED_HOST, buffer_size_gb=gb(8 << 20))
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver, kv = decode(decode_transport, PathSetting.PINNED_HOST, buffer_size_gb=gb(8 << 20))
    sender = KVSender(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)
    sender.piece_bytes = 1  # a piece per layer: copies per piece on both sides
    jobs = {f"t-{n}": (SRC_BLOCKS[n * 40 : n * 40 + 40], DST_BLOCKS[n * 40 : n * 40 + 40]) for n in range(3)}
    try:
        for transfer, (src, dst) in jobs.items():
            receiver.expect(transfer, dst)
            sender.submit(SendJob(transfer, tuple(src), HOST, receiver.port))
        assert [receiver.wait_for(transfer, 60) for transfer in jobs] == ["", "", ""]
        assert sender.wait_idle(30)
        assert set(sender.finished().values()) == {None}
        assert len(mirrors) == 6  # a chunk per transfer, on each side
        for mirror in mirrors:
            (side,) = [side for side in (sender, receiver) if within(mirror.host, side.staging.tensor)]
            assert side.scratch is not None
            assert side.scratch.buffer.numel() == side.staging.capacity == 8 << 20
            offset = mirror.host.data_ptr() - side.staging.tensor.data_ptr()
            assert mirror.work.data_ptr() == side.scratch.buffer.data_ptr() + offset
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
        for src, dst in jobs.values():
            assert torch.equal(kv.gather(dst), want.gather(src))
        assert sender.staging.in_use == receiver.staging.in_use == 0
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


def within(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = view.data_ptr() - buffer.data_ptr()
    return start >= 0 and start + view.numel() <= buffer.numel()


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


class RefusesDeviceMemoryDouble(MooncakeTransport):
    """A TEST DOUBLE of a GPU node without GPUDirect (no peer-memory driver): the real Mooncake TCP
    engine, whose first registration (the device staging) is refused as Mooncake refuses one there."""

    refused = 0

    def register(self, tensor: torch.Tensor) -> None:
        if not self.refused:
            self.refused += 1
            raise TransportError("Mooncake register_memory returned -1 (test double)")
        super().register(tensor)


def test_where_device_memory_cannot_be_registered_auto_stages_in_pinned_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU cache on auto takes the device path; when the transport then refuses device memory, the
    side comes up on pinned-host instead, saying why, and moves KV. The GPU cache is what cannot be
    had here: a double of the decision answers auto as it would for one."""
    real_choose = common_module.choose_path

    def as_for_a_gpu_cache_double(
        kv_device: str, codec: Compression, traits: TransportTraits, setting: PathSetting = PathSetting.AUTO
    ) -> Placement:
        if setting is PathSetting.AUTO:
            return real_choose("cuda", codec, TransportTraits(traits.kind, True, True), setting)
        return real_choose(kv_device, codec, traits, setting)

    monkeypatch.setattr(common_module, "choose_path", as_for_a_gpu_cache_double)
    config = receiver_config(data_path=PathSetting.AUTO, compression=Compression.FP8, async_transfer=False)
    decode_transport, prefill_transport = MooncakeTransport(HOST), RefusesDeviceMemoryDouble(HOST)
    receiver = KVReceiver(
        decode_transport,
        PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY),
        replace(config, data_path=PathSetting.PINNED_HOST),
        HOST,
        0,
    )
    source = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    sender = KVSender(prefill_transport, source, config)
    try:
        assert sender.placement.path is DataPath.PINNED_HOST
        assert "failed (Mooncake register_memory returned -1" in sender.data_path
        hashed = prompt_hash([4, 2])
        receiver.expect("fallback", tuple(range(100, 108)), prompt_hash=hashed)
        sender.submit(SendJob("fallback", tuple(range(10, 18)), HOST, receiver.port, hashed))
        assert sender.finished()["fallback"] is None
        assert receiver.wait_for("fallback", 20) == ""
        got, want = receiver.kv.gather(list(range(100, 108))), source.gather(list(range(10, 18)))
        assert relative_error(got, want) <= RELATIVE_ERROR[Compression.FP8]
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


def test_a_device_override_whose_memory_cannot_be_registered_stops_the_side() -> None:
    """`device` asked for by the operator is not silently changed: the registration's error stands."""
    transport = RefusesDeviceMemoryDouble(HOST)
    kv = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    try:
        with pytest.raises(TransportError, match="register_memory returned -1"):
            KVSender(transport, kv, receiver_config(data_path=PathSetting.DEVICE))
    finally:
        transport.close()
