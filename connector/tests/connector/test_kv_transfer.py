"""Two processes on 127.0.0.1 move a multi-layer paged KV through the real transports.

The decode side (a KVReceiver) runs in the test process, the prefill side (kv_peer.py) in its own
process, with the real Mooncake transfer engine over TCP or a real gloo pair group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
from kv_peer import (
    GEOMETRY,
    HOST,
    NUM_BLOCKS,
    Prefill,
    assert_a_corrupted_payload_fails_on_both_sides,
    make_caches,
    make_transport,
    pipe_config,
    receiver_config,
)

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.base import Transport
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(90)]

TRANSPORTS = ["mooncake", "gloo"]
SRC_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))[:300]]
DST_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(2))[:300]]
RELATIVE_ERROR = {Compression.NONE: 0.0, Compression.FP8: 0.04, Compression.INT8: 0.01}


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    engine = make_transport(request.param)
    yield engine
    engine.close()


@pytest.fixture
def decode(transport: Transport) -> Iterator[tuple[KVReceiver, PagedKV]]:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transport, kv, receiver_config(), HOST, 0)
    yield receiver, kv
    receiver.close()
    assert receiver.staging.in_use == 0
    assert not receiver.pending


@contextlib.contextmanager
def decode_with_staging(transport: Transport, buffer_bytes: int) -> Iterator[tuple[KVReceiver, PagedKV]]:
    """A receiver with a small staging buffer, which no transfer may leave in use."""
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transport, kv, receiver_config(buffer_size_gb=gb(buffer_bytes)), HOST, 0)
    try:
        yield receiver, kv
        assert receiver.staging.in_use == 0
    finally:
        receiver.close()


def transport_kind(transport: Transport) -> str:
    return "mooncake" if transport.one_sided else "gloo"


@pytest.fixture(scope="module")
def prefill(transport: Transport) -> Iterator[Prefill]:
    peer = Prefill(transport_kind(transport))
    yield peer
    peer.close()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# Bytes per piece a batch is written in as it encodes, as sender spec: the default (a batch here is
# smaller: one write), and one layer per piece.
PIECES = {"whole batches": {}, "layer pieces": {"piece_bytes": 1}}


@pytest.mark.parametrize("pieces", PIECES.values(), ids=PIECES.keys())
@pytest.mark.parametrize("compression", list(Compression))
def test_paged_kv_arrives_in_scattered_blocks(
    decode: tuple[KVReceiver, PagedKV], prefill: Prefill, compression: Compression, pieces: dict[str, int]
) -> None:
    receiver, kv = decode
    receiver.expect("t-1", DST_BLOCKS, prompt_hash=prompt_hash([1, 2, 3]))
    prefill.send(
        receiver.port,
        [{"transfer_id": "t-1", "block_ids": SRC_BLOCKS, "hash": prompt_hash([1, 2, 3])}],
        compression=compression.value,
        **pieces,
    )
    assert receiver.wait_for("t-1", timeout=60) == ""
    report = prefill.report()
    assert report[0] == {"transfer_id": "t-1", "error": None}
    assert report[-1]["staging_in_use"] == 0
    source = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    want, got = source.gather(SRC_BLOCKS), kv.gather(DST_BLOCKS)
    assert relative_error(got, want) <= RELATIVE_ERROR[compression]
    untouched = sorted(set(range(NUM_BLOCKS)) - set(DST_BLOCKS))
    assert not bool(kv.gather(untouched).any())
    wire = report[-1]["stats"]["bytes_on_wire"] / report[-1]["stats"]["raw_bytes"]
    assert wire <= (1.0 if compression is Compression.NONE else 0.55)


def test_decode_prefix_hits_are_skipped_and_never_overwritten(
    decode: tuple[KVReceiver, PagedKV], prefill: Prefill
) -> None:
    receiver, kv = decode
    cached = DST_BLOCKS[:10]
    kv.scatter(cached, torch.full(kv.batch_shape(10), 3.0, dtype=torch.bfloat16))
    receiver.expect("t-skip", DST_BLOCKS[10:40], skip=10)
    prefill.send(receiver.port, [{"transfer_id": "t-skip", "block_ids": SRC_BLOCKS[:40]}])
    assert receiver.wait_for("t-skip", timeout=60) == ""
    assert prefill.report()[0]["error"] is None
    source = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    assert torch.equal(kv.gather(DST_BLOCKS[10:40]), source.gather(SRC_BLOCKS[10:40]))
    assert bool((kv.gather(cached) == 3.0).all())


@pytest.mark.parametrize("pieces", PIECES.values(), ids=PIECES.keys())
@pytest.mark.parametrize("compression", [Compression.NONE, Compression.FP8])
def test_corrupted_payload_fails_on_both_sides(
    decode: tuple[KVReceiver, PagedKV], prefill: Prefill, compression: Compression, pieces: dict[str, int]
) -> None:
    receiver, _ = decode
    assert_a_corrupted_payload_fails_on_both_sides(
        receiver, prefill, DST_BLOCKS[:50], SRC_BLOCKS[:50], compression=compression.value, **pieces
    )


def test_prefill_dying_mid_transfer_fails_within_the_timeout(transport: Transport) -> None:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transport, kv, receiver_config(transfer_timeout_ms=1500), HOST, 0)
    try:
        receiver.expect("t-die", DST_BLOCKS[:20])
        dying = Prefill(transport_kind(transport))
        dying.send(
            receiver.port,
            [{"transfer_id": "t-die", "block_ids": SRC_BLOCKS[:20]}],
            compression="int8",
            double="die",
        )
        assert dying.process.wait(timeout=60) == 3
        started = time.monotonic()
        outcome = receiver.wait_for("t-die", timeout=30)
        assert outcome is not None
        assert outcome.startswith("KV load failed")
        assert time.monotonic() - started < 5
        assert receiver.staging.in_use == 0
    finally:
        receiver.close()


def test_prefill_that_never_sends_times_out(transport: Transport) -> None:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transport, kv, receiver_config(prefill_wait_ms=300), HOST, 0)
    try:
        started = time.monotonic()
        receiver.expect("t-never", DST_BLOCKS[:5])
        outcome = receiver.wait_for("t-never", timeout=10)
        assert outcome == "prefill sent nothing within 0.3s"
        assert 0.25 < time.monotonic() - started < 3
        assert receiver.stats.timeouts == 1
        assert not receiver.pending
    finally:
        receiver.close()


def test_unreachable_decode_fails_the_send_within_the_timeout(transport: Transport) -> None:
    kv = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    sender = KVSender(
        transport, kv, pipe_config(buffer_size_gb=gb(1 << 20), transfer_timeout_ms=500, async_transfer=True)
    )
    with socket_port() as port:
        started = time.monotonic()
        sender.submit(SendJob("t-nobody", tuple(SRC_BLOCKS[:4]), HOST, port))
        assert sender.wait_idle(timeout=10)
    sender.close()
    outcome = sender.finished()
    assert "cannot reach the KV side channel" in str(outcome["t-nobody"])
    assert time.monotonic() - started < 3
    assert sender.staging.in_use == 0
    assert sender.stats.failed_sends == 1


def test_mismatched_cache_geometry_is_refused_clearly(
    decode: tuple[KVReceiver, PagedKV], prefill: Prefill
) -> None:
    receiver, _ = decode
    receiver.expect("t-geo", DST_BLOCKS[:4])
    other = vars(GEOMETRY) | {"model": "another-model"}
    prefill.send(receiver.port, [{"transfer_id": "t-geo", "block_ids": SRC_BLOCKS[:4]}], geometry=other)
    outcome = receiver.wait_for("t-geo", timeout=60)
    assert outcome is not None
    assert "KV cache mismatch" in outcome
    assert "model: ours 'tiny-test', peer 'another-model'" in outcome
    assert "KV cache mismatch" in prefill.report()[0]["error"]


def test_a_mismatched_offer_before_decode_expects_its_id_fails_the_expectation_when_it_comes(
    decode: tuple[KVReceiver, PagedKV], prefill: Prefill
) -> None:
    """Prefill is often first: its offer is refused for the layout, and decode, expecting the id a
    moment later, fails at once with that reason instead of waiting prefill_wait for KV that never
    comes (prefill sends once)."""
    receiver, _ = decode
    other = vars(GEOMETRY) | {"model": "another-model"}
    prefill.send(receiver.port, [{"transfer_id": "t-early", "block_ids": SRC_BLOCKS[:4]}], geometry=other)
    assert "KV cache mismatch" in prefill.report()[0]["error"]
    started = time.monotonic()
    receiver.expect("t-early", DST_BLOCKS[:4])
    outcome = receiver.wait_for("t-early", timeout=60)
    assert time.monotonic() - started < 1
    assert outcome is not None
    assert "model: ours 'tiny-test', peer 'another-model'" in outcome
    assert receiver.record("t-early").state == "failed"
    assert receiver.pending == set()


def test_tokenization_mismatch_is_refused(decode: tuple[KVReceiver, PagedKV], prefill: Prefill) -> None:
    receiver, _ = decode
    receiver.expect("t-tok", DST_BLOCKS[:4], prompt_hash=prompt_hash([1, 2]))
    prefill.send(
        receiver.port,
        [{"transfer_id": "t-tok", "block_ids": SRC_BLOCKS[:4], "hash": prompt_hash([1, 3])}],
    )
    outcome = receiver.wait_for("t-tok", timeout=60)
    assert outcome is not None
    assert "tokenization mismatch" in outcome
    assert "tokenization mismatch" in prefill.report()[0]["error"]  # decode's reason reached prefill


@pytest.mark.parametrize("pieces", PIECES.values(), ids=PIECES.keys())
def test_nan_kv_under_int8_fails_fast_on_both_sides(
    decode: tuple[KVReceiver, PagedKV], prefill: Prefill, pieces: dict[str, int]
) -> None:
    """With pieces, the NaN scale is found after some layers were on the wire: the load still fails."""
    receiver, _ = decode
    receiver.expect("t-nan", DST_BLOCKS[:20])
    started = time.monotonic()
    prefill.send(
        receiver.port,
        [{"transfer_id": "t-nan", "block_ids": SRC_BLOCKS[:20]}],
        compression="int8",
        nan=True,
        **pieces,
    )
    outcome = receiver.wait_for("t-nan", timeout=30)
    assert outcome is not None
    assert "hold NaN or inf" in outcome
    assert time.monotonic() - started < 5  # not the 10 s transfer timeout: decode was told
    report = prefill.report()
    assert "hold NaN or inf" in report[0]["error"]
    assert report[-1]["staging_in_use"] == 0


def test_transfer_larger_than_decode_staging(transport: Transport, prefill: Prefill) -> None:
    """A payload larger than decode's staging buffer flows through it: two-sided transports stage one
    batch at a time, one-sided ones a window of batches that decode names to prefill as it frees them."""
    with decode_with_staging(transport, 2 << 20) as (receiver, kv):
        receiver.expect("t-big", DST_BLOCKS)  # 300 blocks: 4.9 MB as fp8, 9.8 MB raw
        prefill.send(receiver.port, [{"transfer_id": "t-big", "block_ids": SRC_BLOCKS}], compression="fp8")
        assert receiver.wait_for("t-big", timeout=60) == ""
        report = prefill.report()
        assert report[0]["error"] is None
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        assert relative_error(kv.gather(DST_BLOCKS), want) <= RELATIVE_ERROR[Compression.FP8]
        assert report[-1]["staging_in_use"] == 0


class socket_port:
    """A free local port with nothing listening on it (bound, never listened, then closed)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind((HOST, 0))
        return int(self._sock.getsockname()[1])

    def __exit__(self, *_: object) -> None:
        self._sock.close()


def test_corrupted_payload_through_a_staging_window_frees_it(transport: Transport, prefill: Prefill) -> None:
    """A checksum failure in a windowed transfer ends it on both sides with every slot freed, and the
    next transfer through the same receiver loads."""
    with decode_with_staging(transport, 2 << 20) as (receiver, _):
        receiver.expect("t-bad", DST_BLOCKS)
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-bad", "block_ids": SRC_BLOCKS}],
            compression="fp8",
            double="corrupt",
        )
        outcome = receiver.wait_for("t-bad", timeout=60)
        assert outcome is not None
        assert "checksum" in outcome
        assert "checksum" in prefill.report()[0]["error"]
        assert receiver.staging.in_use == 0
        receiver.expect("t-next", DST_BLOCKS)
        prefill.send(receiver.port, [{"transfer_id": "t-next", "block_ids": SRC_BLOCKS}], compression="fp8")
        assert receiver.wait_for("t-next", timeout=60) == ""
        assert prefill.report()[-1]["staging_in_use"] == 0


def test_a_batch_larger_than_decode_staging_is_refused_clearly(
    transport: Transport, prefill: Prefill
) -> None:
    with decode_with_staging(transport, 64 << 10) as (receiver, _):
        receiver.expect("t-huge", DST_BLOCKS[:50])  # 16-block batches: 262 kB each as fp8
        prefill.send(
            receiver.port, [{"transfer_id": "t-huge", "block_ids": SRC_BLOCKS[:50]}], compression="fp8"
        )
        outcome = receiver.wait_for("t-huge", timeout=60)
        assert outcome is not None
        assert "exceed the 65536-byte staging buffer" in outcome
        assert "exceed the 65536-byte staging buffer" in prefill.report()[0]["error"]


def test_concurrent_transfers_larger_than_decode_staging_all_load(
    transport: Transport, prefill: Prefill
) -> None:
    """Three prefills at once, each payload larger than decode's staging: their windows (two
    batches each) do not all fit the buffer at once, and all three load (a window that waited for
    room while holding slots would deadlock them until the timeout)."""
    others = [Prefill(transport_kind(transport)) for _ in range(2)]
    try:
        with decode_with_staging(transport, 1536 << 10) as (receiver, kv):
            thirds = [(SRC_BLOCKS[i::3], DST_BLOCKS[i::3]) for i in range(3)]  # 100 blocks: 1.7 MB as fp8
            for index, (peer, (src, dst)) in enumerate(zip([prefill, *others], thirds, strict=True)):
                receiver.expect(f"t-{index}", dst)
                peer.send(receiver.port, [{"transfer_id": f"t-{index}", "block_ids": src}], compression="fp8")
            assert [receiver.wait_for(f"t-{index}", timeout=60) for index in range(3)] == ["", "", ""]
            for peer in [prefill, *others]:
                report = peer.report()
                assert report[0]["error"] is None
                assert report[-1]["staging_in_use"] == 0
            want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
            assert relative_error(kv.gather(DST_BLOCKS), want) <= RELATIVE_ERROR[Compression.FP8]
    finally:
        for peer in others:
            peer.close()
