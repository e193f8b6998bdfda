"""The device work of a side off the host path, sender and receiver in this process over Mooncake
(TCP), CPU tensors: the pinned-host scratch (a send it cannot be had for fails and frees its
staging; concurrent transfers share one, bounded by the staging), the zero-copy device
checksum, taken a layer at a time, and the fences of each thread's own stream (a send's work has
run before its outcome is told; decode reads what landed after the stream Mooncake's TCP build
copies on).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from data_path_cases import DST_BLOCKS, SRC_BLOCKS, decode, deliver_all
from kv_peer import GEOMETRY, HOST, LAYERS, NUM_BLOCKS, CorruptingSender, make_caches, receiver_config

from dllm_connector.codec.device_checksum import RunningTensorChecksum
from dllm_connector.layout import PagedKV
from dllm_connector.pipe import chunk_encoder as encoder_module
from dllm_connector.pipe import chunk_reader as reader_module
from dllm_connector.pipe import sender as sender_module
from dllm_connector.pipe import span_checksum
from dllm_connector.pipe.common import chunk_ranges, gb
from dllm_connector.pipe.device_copy import Copies, HostMirror
from dllm_connector.pipe.layer_stream import LayerStream
from dllm_connector.pipe.part_channel import PartChannel
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import PathSetting
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


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
        deliver_all(sender, receiver, jobs)
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


@pytest.mark.parametrize("fails", [False, True], ids=["delivered", "failed"])
def test_a_send_is_told_ended_only_after_its_threads_work_ran(
    monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """gpu-review item 13: a send's kernels run on its thread's own stream, which vLLM's does not wait
    for, and vLLM frees (and reuses) the request's blocks once the send is told ended. So the send
    settles its stream first, delivered or failed: here `settle` is spied on (a no-op on the CPU) and
    sees the transfer still in flight, on the send's own thread."""
    settled: list[tuple[str, set[str]]] = []
    config = receiver_config(compression=Compression.FP8)
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver = KVReceiver(decode_transport, PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config, HOST, 0)
    sender = KVSender(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)

    def settle_spy(device: torch.device) -> None:
        settled.append((threading.current_thread().name, sender.in_flight))

    monkeypatch.setattr(sender_module, "settle", settle_spy)
    try:
        if fails:
            receiver.expect("t", tuple(range(100, 104)), prompt_hash=prompt_hash([1]))  # another prompt
        else:
            receiver.expect("t", tuple(range(100, 104)))
        hashed = prompt_hash([2]) if fails else ""
        sender.submit(SendJob("t", tuple(range(10, 14)), HOST, receiver.port, hashed))
        assert sender.wait_idle(30)
        reason = sender.finished()["t"]
        assert (reason is not None) == fails, reason
        assert settled == [("kv-send-t", {"t"})]  # once, where the send ran, before the outcome
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


@pytest.mark.parametrize("path", [PathSetting.DEVICE, PathSetting.PINNED_HOST])
def test_decode_reads_what_landed_only_after_waiting_for_the_stream_mooncake_copies_on(
    monkeypatch: pytest.MonkeyPatch, path: PathSetting
) -> None:
    """Every piece and chunk message decode reads is followed by `Copies.landed` before the layers it
    names are placed or hashed (on CUDA: a wait of the thread's stream for the legacy default one,
    where Mooncake's TCP build copies into device memory). Spied on here, zero-copy and staged a
    piece per layer."""
    events: list[str] = []
    monkeypatch.setattr(Copies, "landed", lambda self: events.append("landed"))
    real_checksum, real_finish = span_checksum.chunk_checksum, LayerStream.finish
    real_place = LayerStream.place_until

    def checksum_spy(*args: Any) -> Any:
        events.append("read")
        return real_checksum(*args)

    def finish_spy(self: Any, header: Any) -> None:
        events.append("read")
        real_finish(self, header)

    def place_spy(self: Any, parts: int) -> None:
        events.append("read")
        real_place(self, parts)

    real_next = PartChannel.next_message

    def message_spy(self: PartChannel) -> Any:
        events.append("message")
        return real_next(self)

    monkeypatch.setattr(reader_module, "chunk_checksum", checksum_spy)
    monkeypatch.setattr(LayerStream, "place_until", place_spy)
    monkeypatch.setattr(PartChannel, "next_message", message_spy)
    monkeypatch.setattr(LayerStream, "finish", finish_spy)
    config = receiver_config(data_path=path, async_transfer=False)
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver, kv = decode(decode_transport, path, async_transfer=False)
    sender = KVSender(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)
    sender.piece_bytes = 1  # staged: a piece per layer, each placed as its message arrives
    try:
        receiver.expect("t", DST_BLOCKS)
        sender.submit(SendJob("t", tuple(SRC_BLOCKS), HOST, receiver.port))
        assert receiver.wait_for("t", 30) == ""
        assert sender.finished()["t"] is None
        chunks = chunk_ranges(len(SRC_BLOCKS), sender._chunk_blocks(len(SRC_BLOCKS)))
        assert events.count("read") >= len(chunks)  # a chunk's end, and each piece placed before it
        # between each message and a read of what it announced, the wait
        last = ""
        for event in events:
            if event in ("message", "landed"):
                last = event
            elif event == "read":
                assert last == "landed", events
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        assert torch.equal(kv.gather(DST_BLOCKS), want)
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()
