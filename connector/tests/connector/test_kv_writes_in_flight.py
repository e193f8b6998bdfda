"""Several writes on the wire at once (gpu-review item 12): the writer starts up to WRITES_IN_FLIGHT
pieces before it waits for the oldest, tells decode of each only once it landed, in order, and frees
nothing a write may still read; over Mooncake, writes begun with its async batch calls land whole."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from data_path_cases import DST_BLOCKS, SRC_BLOCKS, decode
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, receiver_config

from dllm_connector import codec
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.chunk_writer import WRITES_IN_FLIGHT, ChunkWriter, Plan, PreparedChunk, PreparedPiece
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.base import PendingWrite, Source, Span, Transport, TransportError
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import PathSetting
from dllm_connector.transport.sidechannel.framing import recv_message
from dllm_connector.transport.staging import StagingBuffer
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

PIECES = 6


class _LandsWhenWaited(PendingWrite):
    def __init__(self, events: list[str], addr: int, fails: bool) -> None:
        self._events, self._addr, self._fails = events, addr, fails

    def wait(self) -> None:
        self._events.append(f"landed {self._addr}")
        if self._fails:
            raise TransportError(f"write to {self._addr} failed (test double)")


class InFlightTransportDouble(Transport):
    """Test double: a one-sided transport whose writes land when the writer waits for them, recording
    when each began and landed (what no real transport reports); `failing` names a write that fails."""

    name = "in-flight"
    one_sided = True

    def __init__(self, events: list[str], failing: int | None = None) -> None:
        self.events, self.failing = events, failing

    def start_send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> PendingWrite:
        self.events.append(f"start {dst[0].addr}")
        return _LandsWhenWaited(self.events, dst[0].addr, dst[0].addr == self.failing)

    def send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> None:
        raise AssertionError("the writer begins writes with start_send")

    def register(self, tensor: torch.Tensor) -> None:
        return None

    def unregister(self, tensor: torch.Tensor) -> None:
        return None

    def endpoint(self) -> dict[str, Any]:
        return {}

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


def _write_pieces_and_a_chunk(
    transport: InFlightTransportDouble, staging: StagingBuffer
) -> BaseException | None:
    """PIECES pieces then their chunk through a writer; decode's notes are appended to the events as
    they arrive. The first piece is ready only once the writer's queue holds the next ones, so it
    finds them waiting. The writer's error, if any."""
    ours, theirs = socket.socketpair()
    queued = threading.Event()

    def first_ready() -> None:
        queued.wait(10.0)

    def read_notes() -> None:
        while True:
            try:
                message = recv_message(theirs, 20.0)
            except (TransportError, OSError):
                return
            transport.events.append(f"note {message['type']} {message['index']}/{message.get('parts', '-')}")

    reader = threading.Thread(target=read_notes, daemon=True)
    reader.start()
    writer = ChunkWriter(transport, 5.0, staging, ours, Plan(0, 1, 1, None, 1, {}), torch.device("cpu"))
    error: BaseException | None = None
    try:
        for index in range(PIECES):
            ready = first_ready if index == 0 else None
            writer.put(PreparedPiece([Span(1, 8)], [Span(100 + index, 8)], 0, index + 1, ready))
            if index == WRITES_IN_FLIGHT:  # the writer's queue is full: let the first go
                queued.set()
        header = codec.KVHeader(Compression.NONE, "bfloat16", (1, 4), 1, 0)
        writer.put(PreparedChunk(0, header, [Span(1, 8)], [Span(200, 8)], staging.reserve(8, 1.0)))
        writer.finish()
    except TransportError as raised:
        error = raised
        writer.stop(raised)
        with contextlib.suppress(TransportError):
            writer.finish()
    finally:
        ours.close()
        reader.join(20.0)
        theirs.close()
    return error


def test_the_writer_keeps_several_writes_on_the_wire_and_notes_each_once_it_landed() -> None:
    events: list[str] = []
    staging = StagingBuffer(1 << 12)
    assert _write_pieces_and_a_chunk(InFlightTransportDouble(events), staging) is None
    starts = [event for event in events if event.startswith("start")]
    landed = [event for event in events if event.startswith("landed")]
    assert starts == [f"start {100 + n}" for n in range(PIECES)] + ["start 200"]
    assert landed == [event.replace("start", "landed") for event in starts]  # in order, every one
    # the first WRITES_IN_FLIGHT begin before any lands, and never more are on the wire at once
    assert events.index(f"landed {100}") > events.index(f"start {100 + WRITES_IN_FLIGHT - 1}")
    on_wire = 0
    for event in events:
        on_wire += event.startswith("start") - event.startswith("landed")
        assert on_wire <= WRITES_IN_FLIGHT
    # decode hears of each piece's parts, then of the chunk, each only after its write landed
    notes = [event for event in events if event.startswith("note")]
    assert notes == [f"note piece 0/{n + 1}" for n in range(PIECES)] + ["note chunk 0/-"]
    for n in range(PIECES):
        assert events.index(f"note piece 0/{n + 1}") > events.index(f"landed {100 + n}")
    assert events.index("note chunk 0/-") > events.index("landed 200")
    assert staging.in_use == 0


def test_a_failed_write_tells_decode_nothing_more_and_frees_the_staging_after_every_write_landed() -> None:
    events: list[str] = []
    staging = StagingBuffer(1 << 12)
    error = _write_pieces_and_a_chunk(InFlightTransportDouble(events, failing=101), staging)
    assert error is not None
    assert "write to 101 failed" in str(error)
    notes = [event for event in events if event.startswith("note")]
    assert notes == ["note piece 0/1"]  # the piece before the failed one only
    starts = [event for event in events if event.startswith("start")]
    landed = [event for event in events if event.startswith("landed")]
    assert landed == [event.replace("start", "landed") for event in starts]  # none left on the wire
    assert staging.in_use == 0


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.FP8])
def test_writes_begun_over_mooncake_land_whole(compression: Compression) -> None:
    """Sender and receiver in this process over Mooncake (TCP), a piece per layer so several are on the
    wire at once: every block arrives (none: byte for byte), and nothing stays reserved."""
    config = receiver_config(data_path=PathSetting.HOST, compression=compression, async_transfer=False)
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver, kv = decode(decode_transport, PathSetting.HOST, compression=compression, async_transfer=False)
    sender = KVSender(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)
    sender.piece_bytes = 1
    sender.zero_copy_piece_bytes = 1
    try:
        receiver.expect("in-flight", DST_BLOCKS)
        sender.submit(SendJob("in-flight", tuple(SRC_BLOCKS), HOST, receiver.port))
        assert receiver.wait_for("in-flight", 30) == ""
        assert sender.finished()["in-flight"] is None
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        got = kv.gather(DST_BLOCKS)
        if compression is Compression.NONE:
            assert torch.equal(got, want)
        else:
            assert float((got.float() - want.float()).norm() / want.float().norm()) <= 0.04
        assert sender.staging.in_use == 0
        assert receiver.staging.in_use == 0
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()
