"""Prefill's write path: chunks and their pieces go on the wire in order, several at once."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm_connector import codec
from dllm_connector.layout import BlockAddresses, HeadRange
from dllm_connector.pipe.common import send
from dllm_connector.pipe.device_copy import Ready
from dllm_connector.pipe.messages import Chunk, Piece
from dllm_connector.thread_device import on_device
from dllm_connector.transport.base import Source, Span, Transport, TransportError
from dllm_connector.transport.staging import StagingBuffer


@dataclass(frozen=True)
class ZeroCopyTarget:
    """Where decode takes a zero-copy part: its caches' addresses, and its blocks in the part's order."""

    addresses: BlockAddresses
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """What the receiver accepted: which blocks, in which chunks, and where they go."""

    skip: int
    count: int
    chunk_blocks: int
    dst: ZeroCopyTarget | None  # zero-copy: decode's block addresses and its blocks for the part
    tag: int
    peer: dict[str, Any]
    heads: HeadRange | None = None  # this rank's heads that travel; None: all of them
    zero_copy: bool = False
    slots: dict[int, int] = field(default_factory=dict)  # chunk index -> decode's staging address


@dataclass
class PreparedChunk:
    index: int
    header: codec.KVHeader
    src: list[Source]
    dst: list[Span]
    staged: torch.Tensor | None
    ready: Ready | None = None  # waited for before the transport reads src (device work, copies)


@dataclass(frozen=True)
class PreparedPiece:
    """Part of a chunk that is final (encoded and hashed), written before the rest of it is ready.

    `parts`: for staged payloads, how many of the chunk's parts (layers) are then in place, which
    the receiver is told so it can decode them while the rest is on the wire.
    """

    src: Sequence[Source]
    dst: Sequence[Span]
    index: int
    parts: int | None = None
    ready: Ready | None = None


@dataclass(frozen=True)
class StagingRelease:
    """Staging of a chunk that failed after some of its pieces were queued: freed once they are written."""

    staged: torch.Tensor


_Item = PreparedChunk | PreparedPiece | StagingRelease


class ChunkWriter:
    """Writes prepared chunks in order on threads of its own, so chunk k+1 encodes while k is on the
    wire.

    One-sided transports write first and then announce the chunk (its header, with the checksum);
    a chunk's pieces go ahead of it as they are encoded, up to the transport's `writes_in_flight` at
    once (gpu-review item 12: over RDMA each call's fixed cost is covered by the others' bytes). One
    thread starts the writes in order (after each one's ready mark); another waits for them in the
    same order, then announces what landed and releases staging. Two-sided ones announce first so
    the receiver can post its receive, and write one at a time.
    """

    def __init__(
        self,
        transport: Transport,
        timeout: float,
        staging: StagingBuffer,
        sock: socket.socket,
        plan: Plan,
        device: torch.device,
    ) -> None:
        """`device`: the KV's, whose events the writer waits on before a write."""
        self._transport, self._timeout, self._staging = transport, timeout, staging
        self._sock, self._plan = sock, plan
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=4)
        self._started: queue.Queue[_Started | None] = queue.Queue()  # in the order they began
        self._in_flight = threading.Semaphore(transport.writes_in_flight if transport.one_sided else 1)
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._halt = threading.Event()  # set at the first error: writes under way start no more batches
        self._threads = [
            threading.Thread(target=on_device(device, self._start_loop), name="kv-chunk-writer", daemon=True),
            threading.Thread(target=on_device(device, self._end_loop), name="kv-chunk-written", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def put(self, item: _Item) -> None:
        """Hand `item` over (the writer releases its staging, in order, after any write under way)."""
        self._queue.put(item)
        if self._error is not None:
            raise self._error

    def stop(self, error: BaseException) -> None:
        """Write nothing more: what is queued is released unwritten (writes under way complete)."""
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
        self._halt.set()

    def _start_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                self._in_flight.acquire()  # given back once the write ended
                self._started.put(_Started(item, self._start(item)))
        finally:
            self._started.put(None)

    def _end_loop(self) -> None:
        while (started := self._started.get()) is not None:
            self._end(started)

    def _start(self, item: _Item) -> Callable[[], None] | None:
        """Begin item's write once it is ready; what waits for it, or None where none began."""
        if self._error is not None or isinstance(item, StagingRelease):
            return None
        transport = self._transport
        try:
            if isinstance(item, PreparedChunk) and not transport.one_sided:
                send(self._sock, _announcement(item))
            if item.ready is not None:  # the device's encode, or its copy to host, done
                item.ready()
                if isinstance(item, PreparedChunk):
                    item.ready = None  # waited for: nothing left to wait for at its release
            if not item.src:
                return _nothing_written
            plan = self._plan
            return transport.begin_send(plan.peer, item.src, item.dst, plan.tag, self._timeout, self._halt)
        except Exception as error:  # noqa: BLE001 - raised again by put/finish in the sender
            self._failed_write(error)
            return None

    def _end(self, started: _Started) -> None:
        """Wait for a started write (every one, even after an error: its memory is in use until it
        ends), then announce what it wrote and release the item's staging."""
        item = started.item
        try:
            if started.finish is not None:
                started.finish()
                if self._error is None:
                    self._announce(item)
        except Exception as error:  # noqa: BLE001 - raised again by put/finish in the sender
            self._failed_write(error)
        finally:
            self._in_flight.release()
            try:
                self._release(item)
            except Exception as error:  # noqa: BLE001 - this thread must go on to the next one
                self._fail(error)

    def _failed_write(self, error: Exception) -> None:
        if isinstance(error, TransportError):
            self._transport.forget_peer(self._plan.peer)
        self._fail(error)

    def _announce(self, item: _Item) -> None:
        if not self._transport.one_sided:
            return
        if isinstance(item, PreparedPiece) and item.parts is not None:
            send(self._sock, Piece(type="piece", index=item.index, parts=item.parts))
        if isinstance(item, PreparedChunk):
            send(self._sock, _announcement(item))

    def _release(self, item: _Item) -> None:
        if not isinstance(item, PreparedPiece) and item.staged is not None:
            if isinstance(item, PreparedChunk) and item.ready is not None:
                # not written (an error came first): its copies into the staging, on the encoding
                # thread's streams, are done before another transfer reserves it
                with contextlib.suppress(Exception):
                    item.ready()
            self._staging.release(item.staged)

    def finish(self) -> None:
        """Wait for every queued chunk; raises the first write error."""
        self._queue.put(None)
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error


@dataclass(frozen=True)
class _Started:
    item: _Item
    finish: Callable[[], None] | None  # waits for its write; None: none began


def _nothing_written() -> None:
    return None


def _announcement(chunk: PreparedChunk) -> Chunk:
    return Chunk(type="chunk", index=chunk.index, header=chunk.header.to_dict())


class PieceStream:
    """Hands a chunk's payload to the writer in pieces as its parts become final.

    A piece goes once at least `piece_bytes` are final; `poll` runs before it (decode may have told
    the sender to stop, H5) and `before_write` between its checksum and its write.
    """

    def __init__(
        self,
        writer: ChunkWriter,
        index: int,
        local: int,
        remote: int,
        poll: Callable[[], None],
        *,
        piece_bytes: int,
        before_write: Callable[[int, Sequence[Source]], None],
    ) -> None:
        self._writer, self._index, self._poll = writer, index, poll
        self._piece_bytes, self._before_write = piece_bytes, before_write
        self._local, self._remote = local, remote
        # Per kind of range (data, scales; each comes in order): up to where it was handed to the
        # writer, and up to where it is final.
        self._sent: list[int] = []
        self._ready: list[int] = []
        self._parts = 0
        self._pending = 0  # final bytes not handed over yet
        self.sent = False  # whether a piece went to the writer (which may still be reading it)
        self.ready: Ready | None = None  # of the latest part (one stream: it covers the earlier ones)

    def add(self, ranges: list[tuple[int, int]], ready: Ready | None = None) -> None:
        self.ready = ready
        if not self._ready:
            self._sent = [start for start, _ in ranges]
            self._ready = list(self._sent)
        for kind, (_, stop) in enumerate(ranges):
            self._pending += stop - self._ready[kind]
            self._ready[kind] = stop
        self._parts += 1
        if self._pending >= self._piece_bytes:
            self._poll()
            src, dst = self.rest()
            self._before_write(self._index, src)
            self._writer.put(PreparedPiece(src, dst, self._index, self._parts, self.ready))
            self.sent = True

    def rest(self) -> tuple[list[Source], list[Span]]:
        """The final bytes not handed over yet, one write per kind of range (none if there are none)."""
        src: list[Source] = []
        dst: list[Span] = []
        for start, end in zip(self._sent, self._ready, strict=True):
            if end > start:
                src.append(Span(self._local + start, end - start))
                dst.append(Span(self._remote + start, end - start))
        self._sent, self._pending = list(self._ready), 0
        return src, dst
