"""The parts the device and pinned-host data paths are built from, each alone on CPU tensors: the
(pinned) staging buffer, the host mirror's copies each way, a reservation's slice of the scratch,
a zero-copy chunk's layers gathered through a bounded buffer, and the writer waiting for each
piece's ready mark before the transport reads it.
"""

from __future__ import annotations

import ctypes
import functools
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from kv_peer import rank_kv
from peer_doubles import OneSidedTransportDouble, wait_until

from dllm_connector import codec
from dllm_connector.codec.device_checksum import tensor_checksum
from dllm_connector.layout import TPRank
from dllm_connector.pipe.chunk_writer import ChunkWriter, Plan, PreparedChunk, PreparedPiece
from dllm_connector.pipe.device_copy import Copies, HostMirror, Scratch
from dllm_connector.pipe.span_checksum import chunk_checksum
from dllm_connector.transport.base import Source, Span, TransportError
from dllm_connector.transport.staging import StagingBuffer
from dllm_contract.kvconfig import Compression

CPU = torch.device("cpu")


def test_pinned_staging_without_an_accelerator_is_plain_host_memory_and_says_so() -> None:
    staging = StagingBuffer(1 << 16, pinned=True)
    assert staging.device.type == "cpu"
    assert "plain host memory" in staging.note
    assert StagingBuffer(1 << 16).note == ""


def test_a_pinned_buffer_on_a_device_is_refused() -> None:
    with pytest.raises(TransportError, match="a pinned staging buffer is host memory, not cuda"):
        StagingBuffer(1 << 16, device=torch.device("cuda"), pinned=True)


def test_a_host_mirror_copies_ranges_each_way() -> None:
    """The pinned-host path's copies, synchronous on the CPU: each range lands once it is ready."""
    copies = Copies(torch.device("cpu"))
    work = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:1000].clone()
    host = torch.zeros(1000, dtype=torch.uint8)
    mirror = HostMirror(work, host, copies)
    ready = mirror.to_host([(0, 100), (600, 1000)])
    ready()
    assert torch.equal(host[:100], work[:100])
    assert torch.equal(host[600:], work[600:])
    assert not bool(host[100:600].any())
    host[100:600] = 7
    mirror.to_device([(100, 600)])
    assert bool((work[100:600] == 7).all())
    copies.mark()()  # nothing queued on the CPU: ready at once
    with pytest.raises(ValueError, match="a 10-byte scratch cannot mirror 1000 bytes"):
        HostMirror(work[:10], host, copies)


def test_a_reservation_s_scratch_is_the_slice_at_its_own_offset() -> None:
    """One scratch as large as the staging, whatever the threads: a reservation's is at its offset."""
    staging = StagingBuffer(1 << 16, pinned=True)
    scratch = Scratch(staging, torch.device("cpu"))
    assert scratch.buffer.numel() == staging.capacity
    first, second = staging.reserve(4000, 1.0), staging.reserve(1000, 1.0)
    for view in (first, second, second[10:20]):
        work = scratch.take(view)
        assert work.numel() == view.numel()
        assert work.data_ptr() - scratch.buffer.data_ptr() == view.data_ptr() - staging.tensor.data_ptr()
    with pytest.raises(TransportError, match="are not in the staging buffer"):
        scratch.take(torch.empty(100, dtype=torch.uint8))


def _span_bytes(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The bytes at host addresses, in order (the test's own reading of a CPU cache)."""
    return torch.frombuffer(bytearray(b"".join(ctypes.string_at(a, n) for a, n in spans)), dtype=torch.uint8)


@pytest.mark.parametrize(
    ("layout", "heads"), [("cpu", None), ("cpu", (1, 3)), ("nhd", None), ("nhd", (2, 3))]
)
@pytest.mark.parametrize("max_bytes", [1, 5000, 1 << 30])
def test_gathered_layers_are_the_spans_bytes_in_the_same_order(
    layout: str, heads: tuple[int, int] | None, max_bytes: int
) -> None:
    """Gathered a layer at a time through a bounded buffer, a zero-copy chunk's blocks are the bytes
    its spans list, in order: the device checksum's value is that of the spans, and, where the cache
    gathers in memory order, of the codec-none payload the same blocks gather into, whichever the bound."""
    kv = rank_kv(7, layout, TPRank(0, 2))
    blocks = [40, 3, 17, 95, 4, 5]
    runs = [run.clone() for run in kv.gathered_bytes(blocks, heads, range(1, 3), max_bytes)]
    per_block = kv.batch_nbytes(1, heads) // kv.num_layers
    assert all(run.numel() <= max(max_bytes // per_block, 1) * per_block for run in runs)
    assert torch.equal(torch.cat(runs), _span_bytes(kv.spans(blocks, heads, range(1, 3))))
    running = chunk_checksum(kv, codec.ChecksumAlgo.NH64, blocks, heads)
    running.add_layers(range(2))
    running.add_layers(range(2, kv.num_layers))
    whole = _span_bytes(kv.spans(blocks, heads))
    assert running.value == tensor_checksum(whole)
    payload = kv.gather(blocks, heads=heads).reshape(-1).view(torch.uint8)
    header = codec.KVHeader(
        Compression.NONE, kv.dtype_name, kv.batch_shape(len(blocks), heads), 1, 0, codec.ChecksumAlgo.NH64
    )
    if not kv.layout.heads_outermost:
        # A token-major cache gathers its heads outermost (scale groups per head, gpu-review item 15):
        # its staged payload holds the same bytes in another order. Both ends agree on zero-copy or
        # staged, so a span checksum is never compared with a staged payload's.
        assert running.value == codec.checksum(header, payload)


class RecordingTransportDouble(OneSidedTransportDouble):
    """Test double: a one-sided transport that only records when it was asked to read a source,
    which no real transport reports (the order against the ready marks is what is tested)."""

    def send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> None:
        self.events.append(f"write {dst[0].addr}")


def test_the_writer_reads_a_piece_only_once_its_copy_or_encode_is_done() -> None:
    """Pinned-host and device paths hand pieces over before the device finished them; the writer
    waits for each piece's (and chunk's) ready mark before the transport reads it."""
    events: list[str] = []
    ours, theirs = socket.socketpair()
    staging = StagingBuffer(1 << 12)
    plan = Plan(0, 1, 1, None, 1, {})
    writer = ChunkWriter(RecordingTransportDouble(events), 5.0, staging, ours, plan, torch.device("cpu"))
    try:
        for index in range(3):
            ready = functools.partial(events.append, f"ready {index}")
            writer.put(PreparedPiece([Span(1, 8)], [Span(100 + index, 8)], 0, index + 1, ready))
        header = codec.KVHeader(Compression.NONE, "bfloat16", (1, 4), 1, 0)
        staged = staging.reserve(8, 1.0)
        ready = functools.partial(events.append, "ready chunk")
        writer.put(PreparedChunk(0, header, [Span(1, 8)], [Span(200, 8)], staged, ready))
        writer.finish()
    finally:
        ours.close()
        theirs.close()
    assert events == [
        "ready 0",
        "write 100",
        "ready 1",
        "write 101",
        "ready 2",
        "write 102",
        "ready chunk",
        "write 200",
    ]
    assert staging.in_use == 0


class FailingTransportDouble(RecordingTransportDouble):
    """Test double: a one-sided transport whose every write fails (recorded first)."""

    def send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> None:
        super().send(peer, src, dst, tag, timeout)
        raise TransportError("the peer went away")


def test_a_chunk_left_unwritten_after_a_failed_write_frees_its_staging_only_once_it_is_ready() -> None:
    """gpu-review item 13: after a failed write the writer frees the staging of the chunks queued behind
    it unwritten. Their copies into that staging ran on the encoding thread's streams; another transfer
    may reserve it at once, so the writer waits for the chunk's ready mark before it frees it."""
    events: list[str] = []
    ours, theirs = socket.socketpair()
    staging = StagingBuffer(1 << 12)
    real_release = staging.release

    def release_spy(view: torch.Tensor) -> None:
        events.append(f"release {view.data_ptr() - staging.tensor.data_ptr()}")
        real_release(view)

    staging.release = release_spy  # type: ignore[method-assign]
    writer = ChunkWriter(FailingTransportDouble(events), 5.0, staging, ours, Plan(0, 2, 1, None, 1, {}), CPU)
    header = codec.KVHeader(Compression.NONE, "bfloat16", (1, 4), 1, 0)
    try:
        chunks = [
            PreparedChunk(n, header, [Span(1, 8)], [Span(200 + n, 8)], staging.reserve(8, 1.0), ready)
            for n, ready in enumerate(functools.partial(events.append, f"ready {n}") for n in range(2))
        ]
        writer.put(chunks[0])
        assert wait_until(lambda: "release 0" in events, 10)  # the first write failed, its staging freed
        with pytest.raises(TransportError, match="went away"):
            writer.put(chunks[1])  # queued behind the failure: never written
        with pytest.raises(TransportError, match="went away"):
            writer.finish()
    finally:
        ours.close()
        theirs.close()
    assert events == ["ready 0", "write 200", "release 0", "ready 1", "release 64"]  # 64-byte aligned
    assert staging.in_use == 0
