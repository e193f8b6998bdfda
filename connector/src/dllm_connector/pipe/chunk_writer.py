"""Prefill's write path: chunks (and their pieces) go on the wire in order on their own thread."""

from __future__ import annotations

import collections
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
from dllm_connector.transport.base import WRITTEN, PendingWrite, Source, Span, Transport, TransportError
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

    src: list[Source]
    dst: list[Span]
    index: int
    parts: int | None = None
    ready: Ready | None = None


@dataclass(frozen=True)
class StagingRelease:
    """Staging of a chunk that failed after some of its pieces were queued: freed once they are written."""

    staged: torch.Tensor


_Item = PreparedChunk | PreparedPiece | StagingRelease


# Writes on the wire at once per plan: each write's fixed cost (a Mooncake batch call) overlaps the
# others' bytes (gpu-review item 12).
WRITES_IN_FLIGHT = 4


class ChunkWriter:
    """Writes prepared chunks in order on its own thread, so chunk k+1 encodes while k is on the wire.

    One-sided transports write first and then announce the chunk (its header, with the checksum);
    a chunk's pieces go ahead of it as they are encoded, up to WRITES_IN_FLIGHT writes at once, each
    one's notes to decode (a piece's parts, a chunk's header) sent in order once it landed. Two-sided
    ones announce first so the receiver can post its receive.
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
        self._in_flight: collections.deque[_Written] = collections.deque()
        self._error: BaseException | None = None
        loop = on_device(device, self._loop)
        self._thread = threading.Thread(target=loop, name="kv-chunk-writer", daemon=True)
        self._thread.start()

    def put(self, item: _Item) -> None:
        """Hand `item` over (the writer releases its staging, in order, after any write under way)."""
        self._queue.put(item)
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            try:
                if self._error is not None or isinstance(item, StagingRelease):
                    self._settle_all()  # nothing is freed while a write may still read it (H5)
                    self._release(item)
                else:
                    self._start(item)
            except Exception as error:  # noqa: BLE001 - raised again by put/finish in the sender
                self._fail(error)
                self._settle_all()
                self._release(item)  # it never went on the wire
        self._settle_all()

    def _next(self) -> _Item | None:
        """The next item; while writes are on the wire and none is queued, the oldest is seen through
        first, so decode hears of it without waiting for the next encode."""
        while self._in_flight:
            with contextlib.suppress(queue.Empty):
                return self._queue.get_nowait()
            self._settle_oldest()
        return self._queue.get()

    def stop(self, error: BaseException) -> None:
        """Write nothing more: what is queued is released unwritten (writes under way complete)."""
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error

    def _start(self, item: PreparedChunk | PreparedPiece) -> None:
        transport = self._transport
        announce = None
        if isinstance(item, PreparedChunk):
            announce = Chunk(type="chunk", index=item.index, header=item.header.to_dict())
        if announce is not None and not transport.one_sided:
            send(self._sock, announce)
        if item.ready is not None:  # the device's encode, or its copy to host, done
            item.ready()
        while len(self._in_flight) >= WRITES_IN_FLIGHT:
            self._settle_oldest()
        if self._error is not None:
            raise self._error
        pending = WRITTEN
        if item.src:
            try:
                pending = transport.start_send(
                    self._plan.peer, item.src, item.dst, self._plan.tag, self._timeout
                )
            except TransportError:
                transport.forget_peer(self._plan.peer)
                raise
        self._in_flight.append(_Written(pending, item, announce))

    def _settle_oldest(self) -> None:
        """The oldest write landed (or failed): its notes to decode go, its staging is freed."""
        written = self._in_flight.popleft()
        item, transport = written.item, self._transport
        try:
            written.pending.wait()
            if self._error is not None:
                return
            if isinstance(item, PreparedPiece) and item.parts is not None and transport.one_sided:
                send(self._sock, Piece(type="piece", index=item.index, parts=item.parts))
            if written.announce is not None and transport.one_sided:
                send(self._sock, written.announce)
        except TransportError as error:
            transport.forget_peer(self._plan.peer)
            self._fail(error)
        except Exception as error:  # noqa: BLE001 - raised again by put/finish in the sender
            self._fail(error)
        finally:
            self._release(item)

    def _settle_all(self) -> None:
        while self._in_flight:
            self._settle_oldest()

    def _release(self, item: _Item) -> None:
        if not isinstance(item, PreparedPiece) and item.staged is not None:
            self._staging.release(item.staged)

    def finish(self) -> None:
        """Wait for every queued chunk; raises the first write error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


@dataclass(frozen=True)
class _Written:
    """A write on the wire, with what follows once it landed."""

    pending: PendingWrite
    item: PreparedChunk | PreparedPiece
    announce: Chunk | None


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
