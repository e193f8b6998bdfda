"""Several writes of one transfer on the wire at once (gpu-review item 12): the writer starts a
chunk's pieces without waiting for the one before, up to the transport's `writes_in_flight` (four for
Mooncake over RDMA; over TCP one, which measured faster here), and still announces them, and frees
staging, in order and only once every write started before has ended.

The first test is real KVSender and KVReceiver over real Mooncake transports on 127.0.0.1 (TCP, given
RDMA's four writes at once), with a watch on the transport's batch write (what its writer threads
run). The others drive the writer alone with ManualTransportDouble, whose writes end when the test
says.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, pipe_config
from peer_doubles import OneSidedTransportDouble, wait_until

from dllm_connector import codec
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.chunk_writer import ChunkWriter, Plan, PreparedChunk, PreparedPiece
from dllm_connector.pipe.common import gb, readable
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.base import Source, Span, TransferTimeout, TransportError
from dllm_connector.transport.mooncake import RDMA_WRITES_IN_FLIGHT, MooncakeTransport
from dllm_connector.transport.sidechannel.framing import recv_message
from dllm_connector.transport.staging import StagingBuffer
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

CPU = torch.device("cpu")
SRC = tuple(range(40, 72))
DST = tuple(range(200, 232))


class WriteWatch:
    """Wraps a real MooncakeTransport's batch write: counts the writes under way at once, and holds
    the first until a second one has started (10 s at most), so that overlap shows whenever the
    writer allows it."""

    def __init__(self, transport: MooncakeTransport) -> None:
        self._write = transport._write
        self._lock = threading.Lock()
        self._second = threading.Event()
        self.started = self.running = self.most = 0

    def __call__(self, *args: Any) -> int:
        with self._lock:
            self.started += 1
            self.running += 1
            self.most = max(self.most, self.running)
            first = self.started == 1
            if self.started == 2:
                self._second.set()
        try:
            if first:
                self._second.wait(10)
            return self._write(*args)
        finally:
            with self._lock:
                self.running -= 1


def test_a_transfers_pieces_are_on_the_wire_together_and_land_whole(
    transports: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    decode, prefill = transports
    assert decode.writes_in_flight == prefill.writes_in_flight == 1  # over TCP
    monkeypatch.setattr(prefill, "writes_in_flight", RDMA_WRITES_IN_FLIGHT)
    watch = WriteWatch(prefill)
    monkeypatch.setattr(prefill, "_write", watch)
    config = pipe_config(
        compression=Compression.NONE, buffer_size_gb=gb(16 << 20), transfer_timeout_ms=20_000
    )
    source = PagedKV(make_caches(11), NUM_BLOCKS, GEOMETRY)
    target = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    sender = KVSender(prefill, source, config)
    sender.piece_bytes = sender.zero_copy_piece_bytes = 1  # a write per layer: a chunk is several
    receiver = KVReceiver(decode, target, config, HOST, 0)
    try:
        receiver.expect("in-flight", DST)
        sender.submit(SendJob("in-flight", SRC, HOST, receiver.port))
        assert receiver.wait_for("in-flight", 60) == ""
        assert sender.wait_idle(30)
        assert sender.finished() == {"in-flight": None}
    finally:
        sender.close()
        receiver.close()
    assert torch.equal(target.gather(DST), source.gather(SRC))
    assert watch.started >= source.num_layers
    assert 2 <= watch.most <= RDMA_WRITES_IN_FLIGHT
    assert sender.staging.in_use == 0


class ManualTransportDouble(OneSidedTransportDouble):
    """Test double: a one-sided transport whose writes begin at once and end when the test calls
    `end(k)` (the k-th write, by its destination address), raising TransportError where told."""

    writes_in_flight = 4

    def __init__(self, events: list[str]) -> None:
        super().__init__(events)
        self.stops: dict[int, threading.Event | None] = {}  # what each write was told to stop on
        self._ends: dict[int, threading.Event] = {}
        self._fails: set[int] = set()
        self._lock = threading.Lock()

    def _gate(self, address: int) -> threading.Event:
        with self._lock:
            return self._ends.setdefault(address, threading.Event())

    def end(self, address: int, *, fail: bool = False) -> None:
        if fail:
            self._fails.add(address)
        self._gate(address).set()

    def begin_send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> Callable[[], None]:
        address = dst[0].addr
        self.events.append(f"begin {address}")
        self.stops[address] = stop
        return functools.partial(self._wait, address)

    def _wait(self, address: int) -> None:
        assert self._gate(address).wait(20), f"write {address} was never ended by the test"
        self.events.append(f"end {address}")
        if address in self._fails:
            raise TransportError(f"write {address} failed")

    def send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> None:
        self.begin_send(peer, src, dst, tag, timeout)()


@pytest.fixture
def channel() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def staged_writer(
    events: list[str], sock: socket.socket
) -> tuple[ChunkWriter, ManualTransportDouble, StagingBuffer]:
    transport = ManualTransportDouble(events)
    staging = StagingBuffer(1 << 12)
    real_release = staging.release

    def release_spy(view: torch.Tensor) -> None:
        events.append("release")
        real_release(view)

    staging.release = release_spy  # type: ignore[method-assign]
    return ChunkWriter(transport, 5.0, staging, sock, Plan(0, 1, 1, None, 1, {}), CPU), transport, staging


def announced(sock: socket.socket) -> tuple[str, int]:
    """The next message the writer sent decode: its type and its parts (a piece) or index (a chunk)."""
    message = recv_message(sock, 5)
    return str(message["type"]), int(message["parts"] if message["type"] == "piece" else message["index"])


def a_chunk(staging: StagingBuffer, address: int) -> PreparedChunk:
    header = codec.KVHeader(Compression.NONE, "bfloat16", (1, 4), 1, 0)
    return PreparedChunk(0, header, [Span(1, 8)], [Span(address, 8)], staging.reserve(8, 1.0))


def test_the_writer_starts_a_chunks_writes_together_and_frees_its_staging_after_the_last_ends(
    channel: tuple[socket.socket, socket.socket],
) -> None:
    events: list[str] = []
    writer, transport, staging = staged_writer(events, channel[0])
    for index in range(3):
        writer.put(PreparedPiece([Span(1, 8)], [Span(100 + index, 8)], 0, index + 1))
    writer.put(a_chunk(staging, 200))
    # all four began before any ended: writes_in_flight of them at once
    assert wait_until(lambda: events.count("begin 200") == 1, 10), events
    assert events == ["begin 100", "begin 101", "begin 102", "begin 200"]
    for address in (101, 100, 200, 102):  # the wire may finish them in any order
        transport.end(address)
    writer.finish()
    # waited for in the order they began, the staging freed after the last
    assert events[4:] == ["end 100", "end 101", "end 102", "end 200", "release"]
    assert staging.in_use == 0
    # each piece announced once its write ended, in order, then the chunk's header
    assert [announced(channel[1]) for _ in range(4)] == [
        ("piece", 1),
        ("piece", 2),
        ("piece", 3),
        ("chunk", 0),
    ]
    assert not readable(channel[1], 0)


def test_a_failed_write_stops_the_rest_and_staging_waits_for_the_writes_still_on_the_wire(
    channel: tuple[socket.socket, socket.socket],
) -> None:
    """The first piece fails while the second and the chunk are on the wire: nothing more begins,
    and the chunk's staging is freed only after both ended (they read it until then)."""
    events: list[str] = []
    writer, transport, staging = staged_writer(events, channel[0])
    writer.put(PreparedPiece([Span(1, 8)], [Span(100, 8)], 0, 1))
    writer.put(PreparedPiece([Span(1, 8)], [Span(101, 8)], 0, 2))
    writer.put(a_chunk(staging, 200))
    assert wait_until(lambda: "begin 200" in events, 10), events
    transport.end(100, fail=True)
    assert wait_until(lambda: writer._error is not None, 10)
    with pytest.raises(TransportError, match="write 100 failed"):
        writer.put(PreparedPiece([Span(1, 8)], [Span(300, 8)], 1, 1))  # after the failure: never begun
    transport.end(101)
    transport.end(200)
    with pytest.raises(TransportError, match="write 100 failed"):
        writer.finish()
    assert events == ["begin 100", "begin 101", "begin 200", "end 100", "end 101", "end 200", "release"]
    assert staging.in_use == 0
    # the writes still on the wire were told to stop starting batches at the failure (a deadline of
    # their own still ends them), and nothing was announced: decode learns of the failure instead
    assert all(stop is not None and stop.is_set() for stop in transport.stops.values())
    assert not readable(channel[1], 0)


def test_a_mooncake_write_told_to_stop_writes_nothing(
    transports: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    """A write among several under way whose writer met a failure elsewhere starts no batch."""
    decode, prefill = transports
    sent, landed = torch.full((4096,), 7, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    prefill.register(sent)
    decode.register(landed)
    halt = threading.Event()
    halt.set()
    finish = prefill.begin_send(
        {"session": decode.session_id},
        [Span(sent.data_ptr(), 4096)],
        [Span(landed.data_ptr(), 4096)],
        0,
        10,
        halt,
    )
    with pytest.raises(TransferTimeout, match="stopped"):
        finish()
    assert not bool(landed.any())
    prefill.send(
        {"session": decode.session_id}, [Span(sent.data_ptr(), 4096)], [Span(landed.data_ptr(), 4096)], 0, 10
    )
    assert torch.equal(landed, sent)  # the same write, not told to stop, lands
    prefill.unregister(sent)
    decode.unregister(landed)
