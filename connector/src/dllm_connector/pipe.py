"""KV pipes: a prefill-side sender and a decode-side receiver on codec + transport + side channel.

One transfer, keyed by the router's transfer id (never a vLLM request id), in batches of
transferThresholdTokens (docs/kv-connector.md has the whole exchange):

    sender                                   receiver (decode worker, side channel on kv_port + rank)
    offer {id, cache signature, blocks} ->   checks the signature; waits (up to hold) for decode to
                                             expect the id; names its KV blocks or reserves staging
                                     <-      accept {skip, count, destination spans}
    per batch: gather, encode, write,   ->   per batch: verify the checksum, decode, scatter
               announce {header}             (two-sided transports: announce first, then send)
    done                                ->
                                     <-      ack, or nack {reason}

Mid-stream, decode may nack at any time (the load was cancelled or a chunk failed): the sender
stops writing, waits for the write under way, and answers abort; only then does decode end the
part and report the load, so vLLM never frees blocks that are still written (H5). A connection
whose first message is `end {id}` (the router, when decode refused a request prefill already
sends: messages.end_transfer) makes decode refuse that id's offers at once instead of holding them (M2).

Everything a peer sends is validated (messages.py) before use; every failure on either side ends
the transfer with a recorded, bounded reason, and decode tells a peer which fields differ, never
its own values (H6, L2, L3).

Where the TP sizes differ, a prefill rank opens one such transfer per decode rank it sends heads
to (kv_layout.plan_tp_mapping), and decode's expectation ends when every sender's part did.
Codec none over a one-sided transport writes block to block with no staging copy; compressed KV
(and any two-sided transport) goes through the registered staging buffers. Every expectation ends
exactly once (loaded, failed, timed out or cancelled) and every staging reservation is released.

`KVPipe.send_kv_cache` / `receive_kv_cache` is the seed's tensor API on the same machinery.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from dllm_connector import codec
from dllm_connector.checksum import RunningChecksum, spans_checksum
from dllm_connector.kv_layout import (
    Geometry,
    HeadRange,
    LayoutError,
    PagedKV,
    coalesce,
    plan_tp_mapping,
    signature_mismatches,
)
from dllm_connector.kv_scheduler import prompt_hash
from dllm_connector.messages import (
    Accept,
    Chunk,
    EndTransfer,
    MalformedMessage,
    Offer,
    Piece,
    Slot,
    bounded,
)
from dllm_connector.messages import parse as parse_message
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import Source, Span, TransferTimeout, Transport, TransportError
from dllm_connector.transport.sidechannel import Message, PeerRefused
from dllm_connector.transport.staging import StagingBuffer
from dllm_connector.transport.torchdist import TorchDistTransport
from dllm_contract.kvconfig import Compression, ConnectorExtraConfig

__all__ = [
    "KVPipe",
    "KVReceiver",
    "KVSender",
    "PipeConfig",
    "SendJob",
    "TransferFailed",
    "prompt_hash",
]

_log = logging.getLogger(__name__)
_GB = 1 << 30
# Connection attempts to a decode side channel that is not up yet are retried this often.
_CONNECT_RETRY_S = 0.05
# A transfer is pipelined in chunks (transferThresholdTokens of KV each): chunk k+1 is encoded
# while chunk k is on the wire, and decoded on the other side while k+2 arrives. Without a block
# size (the tensor API) chunks hold about this much raw KV.
_CHUNK_BYTES = 32 << 20
_ALIGN = 64
# Codec none writes block to block only where each run of memory is at least this long. A head
# range on the NHD layout is one short run per token; those are gathered into staging instead
# (measured on 127.0.0.1: 1 KB runs moved 0.01 GB/s zero-copy).
MIN_ZERO_COPY_RUN = 16 << 10
# A thread waiting on a peer wakes this often to see whether its transfer was cancelled or its
# side is closing (a wait is never one long blocking recv).
_POLL_S = 0.05
# Errors a transfer expects (their message says it all); any other exception is a bug or a
# malformed peer: it still ends the transfer, and its traceback is logged once.
_EXPECTED_ERRORS = (TransportError, codec.CodecError, LayoutError)


@dataclass(frozen=True)
class PipeConfig:
    compression: Compression = Compression.NONE
    buffer_bytes: int = 1 << 28
    transfer_timeout_s: float = 5.0
    prefill_wait_s: float = 60.0
    hold_s: float = 480.0
    async_transfer: bool = True
    threshold_tokens: int = 1024  # KV moves in batches (pipeline chunks) of this many tokens
    chunk_bytes: int = _CHUNK_BYTES  # the batch size where the block size is unknown (tensor API)

    @classmethod
    def from_extra(cls, extra: ConnectorExtraConfig) -> PipeConfig:
        return cls(
            compression=extra.compression,
            buffer_bytes=int(extra.buffer_size_gb * _GB),
            transfer_timeout_s=extra.transfer_timeout_ms / 1000,
            prefill_wait_s=extra.prefill_wait_ms / 1000,
            hold_s=float(extra.hold_seconds),
            async_transfer=extra.async_transfer,
            threshold_tokens=extra.transfer_threshold_tokens,
        )


@dataclass
class PipeStats:
    sent: int = 0
    received: int = 0
    failed_sends: int = 0
    failed_receives: int = 0
    timeouts: int = 0
    checksum_failures: int = 0
    stops_requested: int = 0  # senders decode told to stop mid-stream (a cancel or a failed chunk)
    bytes_on_wire: int = 0
    raw_bytes: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


class TransferFailed(TransportError):
    """A transfer ended without the KV in place; the message says why."""


class _RefusedWithDetail(TransferFailed):
    """Refused for a reason whose detail stays local: the peer is told `peer_reason` only (L2)."""

    def __init__(self, detail: str, peer_reason: str) -> None:
        super().__init__(detail)
        self.peer_reason = peer_reason


# ---- sender ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendJob:
    transfer_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    prompt_hash: str = ""
    engine_id: str | None = None  # the decode engine the router named; checked at the handshake
    decode_tp_size: int | None = None  # None: the sender's own TP size (rank r sends to rank r)


@dataclass(frozen=True)
class _Target:
    """One decode rank a send goes to (at the job's port + its rank) and the model heads it gets."""

    decode_rank: int
    model_heads: HeadRange | None  # None: all of this rank's heads (equal TP sizes)


@dataclass(frozen=True)
class _Plan:
    """What the receiver accepted: which blocks, in which chunks, and where they go."""

    skip: int
    count: int
    chunk_blocks: int
    dst: list[Span]
    tag: int
    peer: dict[str, Any]
    heads: HeadRange | None = None  # this rank's heads that travel; None: all of them
    zero_copy: bool = False
    slots: dict[int, int] = field(default_factory=dict)  # chunk index -> decode's staging address


def chunk_ranges(count: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """[start, stop) block ranges of the chunks a transfer is pipelined in (both sides agree)."""
    return [(start, min(start + chunk_blocks, count)) for start in range(0, count, chunk_blocks)]


def _chunk_offsets(sizes: Sequence[int]) -> list[int]:
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor += -(-size // _ALIGN) * _ALIGN
    return [*offsets, cursor]


@dataclass
class _Chunk:
    index: int
    header: codec.KVHeader
    src: list[Source]
    dst: list[Span]
    staged: torch.Tensor | None


@dataclass(frozen=True)
class _Piece:
    """Part of a chunk that is final (encoded and hashed), written before the rest of it is ready.

    `parts`: for staged payloads, how many of the chunk's parts (layers) are then in place, which
    the receiver is told so it can decode them while the rest is on the wire.
    """

    src: list[Source]
    dst: list[Span]
    index: int
    parts: int | None = None


@dataclass(frozen=True)
class _Release:
    """Staging of a chunk that failed after some of its pieces were queued: freed once they are written."""

    staged: torch.Tensor


class _ChunkWriter:
    """Writes prepared chunks in order on its own thread, so chunk k+1 encodes while k is on the wire.

    One-sided transports write first and then announce the chunk (its header, with the checksum);
    a chunk's pieces go ahead of it as they are encoded. Two-sided ones announce first so the
    receiver can post its receive.
    """

    def __init__(self, sender: KVSender, sock: socket.socket, plan: _Plan) -> None:
        self._sender, self._sock, self._plan = sender, sock, plan
        self._queue: queue.Queue[_Chunk | _Piece | _Release | None] = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kv-chunk-writer", daemon=True)
        self._thread.start()

    def put(self, item: _Chunk | _Piece | _Release) -> None:
        """Hand `item` over (the writer releases its staging, in order, after any write under way)."""
        self._queue.put(item)
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._error is None and not isinstance(item, _Release):
                    self._write(item)
            except Exception as error:  # noqa: BLE001 - raised again by put/finish in the sender
                self._error = error
            finally:
                self._release(item)

    def stop(self, error: BaseException) -> None:
        """Write nothing more: what is queued is released unwritten (a write under way completes)."""
        if self._error is None:
            self._error = error

    def _write(self, item: _Chunk | _Piece) -> None:
        transport, timeout = self._sender.transport, self._sender.config.transfer_timeout_s
        announce = None
        if isinstance(item, _Chunk):
            announce = {"type": "chunk", "index": item.index, "header": item.header.to_dict()}
        if announce is not None and not transport.one_sided:
            sidechannel.send_message(self._sock, announce)
        if item.src:
            try:
                transport.send(self._plan.peer, item.src, item.dst, self._plan.tag, timeout)
            except TransportError:
                transport.forget_peer(self._plan.peer)
                raise
        if isinstance(item, _Piece) and item.parts is not None and transport.one_sided:
            sidechannel.send_message(self._sock, {"type": "piece", "index": item.index, "parts": item.parts})
        if announce is not None and transport.one_sided:
            sidechannel.send_message(self._sock, announce)

    def _release(self, item: _Chunk | _Piece | _Release) -> None:
        if not isinstance(item, _Piece) and item.staged is not None:
            self._sender.staging.release(item.staged)

    def finish(self) -> None:
        """Wait for every queued chunk; raises the first write error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


# A chunk goes on the wire in pieces of at least this much as it encodes: the wire starts on the
# first chunk without waiting for all of it, and the calls stay few (each Mooncake write costs ~50 us).
PIECE_BYTES = 8 << 20
# Zero-copy pieces are one Mooncake write per block span: fewer, larger pieces measured better
# (2k tokens on 127.0.0.1: 0.43-0.46 GB/s with 8 MiB pieces, 0.53-0.59 with 32, 0.54-0.62 whole).
ZERO_COPY_PIECE_BYTES = 32 << 20


class _PieceStream:
    """Hands a chunk's payload to the writer in pieces as its parts become final."""

    def __init__(
        self,
        sender: KVSender,
        writer: _ChunkWriter,
        index: int,
        local: int,
        remote: int,
        poll: Callable[[], None],
    ) -> None:
        self._sender, self._writer, self._index, self._poll = sender, writer, index, poll
        self._local, self._remote = local, remote
        # Per kind of range (data, scales; each comes in order): up to where it was handed to the
        # writer, and up to where it is final.
        self._sent: list[int] = []
        self._ready: list[int] = []
        self._parts = 0
        self._pending = 0  # final bytes not handed over yet
        self.sent = False  # whether a piece went to the writer (which may still be reading it)

    def add(self, ranges: list[tuple[int, int]]) -> None:
        if not self._ready:
            self._sent = [start for start, _ in ranges]
            self._ready = list(self._sent)
        for kind, (_, stop) in enumerate(ranges):
            self._pending += stop - self._ready[kind]
            self._ready[kind] = stop
        self._parts += 1
        if self._pending >= self._sender.piece_bytes:
            self._poll()  # decode may have told us to stop (H5)
            src, dst = self.rest()
            self._sender._before_write(self._index, src)
            self._writer.put(_Piece(src, dst, self._index, self._parts))
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


class _PipeSide:
    """What both sides hold: the transport, with the paged KV and a staging buffer registered."""

    def __init__(self, transport: Transport, kv: PagedKV, config: PipeConfig) -> None:
        self.transport = transport
        self.kv = kv
        self.config = config
        self.stats = PipeStats()
        self.staging = StagingBuffer(config.buffer_bytes)
        transport.register(self.staging.tensor)
        kv.register_with(transport.register)

    def _unregister(self) -> None:
        self.transport.unregister(self.staging.tensor)
        for tensor in self.kv.caches:
            self.transport.unregister(tensor)


class KVSender(_PipeSide):
    """Prefill side. Sends run on their own threads when async; `finished()` drains the outcomes.

    `peer_address(host, port)` (C1) is asked before every connection: it returns the address to
    connect to, or raises TransferFailed for a decode peer this engine may not send to. None: any.
    """

    def __init__(
        self,
        transport: Transport,
        kv: PagedKV,
        config: PipeConfig,
        *,
        peer_address: Callable[[str, int], str] | None = None,
        auth: sidechannel.PeerAuth | None = None,
    ) -> None:
        super().__init__(transport, kv, config)
        self._auth = auth
        self._tags = itertools.count(1)
        self.min_zero_copy_run = MIN_ZERO_COPY_RUN
        self.piece_bytes = PIECE_BYTES
        self.zero_copy_piece_bytes = ZERO_COPY_PIECE_BYTES
        self._peer_address = peer_address
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._done: dict[str, str | None] = {}  # transfer id -> None (sent) or the failure reason
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()

    @property
    def in_flight(self) -> set[str]:
        with self._lock:
            return set(self._in_flight)

    def submit(self, job: SendJob) -> None:
        with self._lock:
            self._in_flight.add(job.transfer_id)
        if self._closing.is_set():
            self._record(job, "the KV sender is closing")
            return
        if not self.config.async_transfer:
            self._run(job)
            return
        thread = threading.Thread(
            target=self._run, args=(job,), name=f"kv-send-{job.transfer_id}", daemon=True
        )
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def finished(self) -> dict[str, str | None]:
        """Transfers that ended since the last call: id -> None if delivered, else the reason."""
        with self._lock:
            done, self._done = self._done, {}
        return done

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not self.in_flight and not any(thread.is_alive() for thread in threads)

    def _run(self, job: SendJob) -> None:
        """One job, whatever happens: it ends with a recorded outcome (H6), never a dead thread."""
        reason: str | None = None
        try:
            self.send(job)
        except Exception as error:  # noqa: BLE001 - every failure ends the transfer with a reason
            reason = bounded(str(error) or type(error).__name__)
            self.stats.failed_sends += 1
            self.stats.timeouts += isinstance(error, TransferTimeout)
            unexpected = not isinstance(error, _EXPECTED_ERRORS)
            _log.warning("KV send %s failed: %s", bounded(job.transfer_id), reason, exc_info=unexpected)
        self._record(job, reason)

    def _record(self, job: SendJob, reason: str | None) -> None:
        with self._lock:
            self._in_flight.discard(job.transfer_id)
            self._done[job.transfer_id] = reason

    @property
    def codec(self) -> Compression:
        return codec.effective_codec(self.config.compression, self.kv.dtype)

    @property
    def zero_copy(self) -> bool:
        """Codec none over a one-sided transport on host memory: block-to-block writes, no staging."""
        return self.codec is Compression.NONE and self.transport.one_sided and self.kv.device.type == "cpu"

    def _zero_copy_for(self, heads: HeadRange | None) -> bool:
        """Zero-copy for all heads, or for a head range whose runs are long enough to write one by one."""
        if not self.zero_copy:
            return False
        return heads is None or self.kv.run_nbytes(heads) >= self.min_zero_copy_run

    def targets(self, job: SendJob) -> list[_Target]:
        """The decode ranks this rank sends the job to, with their heads (mapped when TP sizes differ)."""
        own = self.kv.tp
        decode_tp = job.decode_tp_size or own.size
        if decode_tp == own.size:
            return [_Target(own.rank, None)]
        mapping = plan_tp_mapping(self.kv.geometry.model_kv_heads, own.size, decode_tp)
        return [_Target(rank, heads) for rank, heads in mapping.sends_from(own.rank).items()]

    def send(self, job: SendJob) -> None:
        """One blocking transfer to every decode rank it goes to; raises on any failure."""
        targets = self.targets(job)
        if len(targets) == 1:
            self._send_to(job, targets[0])
            return
        errors: dict[int, Exception] = {}
        threads = [
            threading.Thread(target=_catching(self._send_to, errors, target.decode_rank), args=(job, target))
            for target in targets[1:]
        ]
        for thread in threads:
            thread.start()
        if targets:
            _catching(self._send_to, errors, targets[0].decode_rank)(job, targets[0])
        for thread in threads:
            thread.join()
        if errors:
            rank, error = min(errors.items())
            raise _naming_rank(error, rank) from error

    def _send_to(self, job: SendJob, target: _Target) -> None:
        port = job.port + target.decode_rank
        heads = None if target.model_heads is None else self.kv.local_heads(target.model_heads)
        host = self._allowed_address(job)
        with self._connect(host, port) as sock:
            plan = self._offer(sock, job, target, port, heads)
            blocks = job.block_ids[plan.skip : plan.skip + plan.count]
            writer = _ChunkWriter(self, sock, plan)
            wire = raw = 0
            try:
                for index, (start, stop) in enumerate(chunk_ranges(len(blocks), plan.chunk_blocks)):
                    self._poll(sock, plan)
                    chunk = self._prepare(index, blocks[start:stop], start, plan, writer, sock)
                    if chunk.src:
                        self._before_write(index, chunk.src)
                    writer.put(chunk)
                    wire, raw = wire + chunk.header.payload_nbytes, raw + chunk.header.raw_nbytes
                writer.finish()
            except Exception as error:
                # Nothing more is written; once the write under way returned, decode is told we
                # stopped, so it may hand the blocks on (H5).
                writer.stop(error)
                with contextlib.suppress(Exception):
                    writer.finish()
                with contextlib.suppress(TransportError):
                    sidechannel.send_message(sock, {"type": "abort", "reason": bounded(str(error))})
                raise
            sidechannel.send_message(sock, {"type": "done"})
            sidechannel.expect(sock, "ack", self.config.transfer_timeout_s)
        with self._lock:
            self.stats.sent += 1
            self.stats.bytes_on_wire += wire
            self.stats.raw_bytes += raw

    def _allowed_address(self, job: SendJob) -> str:
        """The address to connect to for the job's decode peer (C1); TransferFailed if refused."""
        if self._peer_address is None:
            return job.host
        try:
            return self._peer_address(job.host, job.port)
        except Exception as error:  # noqa: BLE001 - any refusal or lookup failure ends this send
            raise TransferFailed(str(error)) from None

    def _connect(self, host: str, port: int) -> socket.socket:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            try:
                return sidechannel.connect(host, port, self.config.transfer_timeout_s, auth=self._auth)
            except sidechannel.AuthenticationFailed:
                raise  # a retry would only repeat the refusal until the timeout
            except TransportError:
                if time.monotonic() + _CONNECT_RETRY_S > deadline or self._closing.is_set():
                    raise
                time.sleep(_CONNECT_RETRY_S)

    def _chunk_blocks(self, count: int) -> int:
        """Blocks per chunk, at most the transfer's `count` (decode refuses more, L3)."""
        if self.kv.geometry.block_size > 0:
            per_chunk = -(-self.config.threshold_tokens // self.kv.geometry.block_size)
        else:
            block_bytes = len(self.kv.caches) * self.kv.layout.segments * self.kv.segment_nbytes
            per_chunk = self.config.chunk_bytes // max(1, block_bytes)
        return max(1, min(per_chunk, count))

    def _offer(
        self, sock: socket.socket, job: SendJob, target: _Target, port: int, heads: HeadRange | None
    ) -> _Plan:
        offer: dict[str, Any] = {
            "type": "offer",
            "transfer_id": job.transfer_id,
            "prompt_hash": job.prompt_hash,
            "engine_id": job.engine_id,
            "num_blocks": len(job.block_ids),
            "codec": self.codec.value,
            "zero_copy": self._zero_copy_for(heads),
            "chunk_blocks": self._chunk_blocks(len(job.block_ids)),
            "signature": self.kv.signature(),
            "endpoint": self.transport.endpoint(),
            "hold_s": self.config.hold_s,
            "tag": next(self._tags),
            "tp": {
                "rank": self.kv.tp.rank,
                "size": self.kv.tp.size,
                "decode_rank": target.decode_rank,
                "heads": None if target.model_heads is None else list(target.model_heads),
            },
        }
        if isinstance(self.transport, TorchDistTransport):
            offer["endpoint"]["pair"] = self.transport.pair_key(job.host + f":{port}")
        sidechannel.send_message(sock, offer)
        self._await(sock, self.config.hold_s)
        reply = parse(Accept, sidechannel.expect(sock, "accept", self.config.transfer_timeout_s))
        if reply.skip + reply.count > len(job.block_ids):
            raise TransferFailed(
                f"decode accepted blocks {reply.skip}..{reply.skip + reply.count - 1}, "
                f"prefill offered {len(job.block_ids)}"
            )
        chunks = len(chunk_ranges(reply.count, int(offer["chunk_blocks"])))
        if any(index >= chunks for index, _ in reply.slots):
            raise TransferFailed(f"decode named a staging slot beyond chunk {chunks - 1}")
        peer = dict(reply.endpoint) | {"pair": offer["endpoint"].get("pair")}
        return _Plan(
            reply.skip,
            reply.count,
            int(offer["chunk_blocks"]),
            [Span(addr, nbytes) for addr, nbytes in reply.dst],
            int(offer["tag"]),
            peer,
            heads,
            bool(offer["zero_copy"]),
            dict(reply.slots),
        )

    def _await(self, sock: socket.socket, timeout: float) -> None:
        """Wait until the peer's next message is there; stops early when this sender closes."""
        deadline = time.monotonic() + timeout
        while not _readable(sock, min(_POLL_S * 10, max(0.0, deadline - time.monotonic()))):
            if self._closing.is_set():
                raise TransferFailed("the KV sender is closing")
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"decode did not accept within {timeout:.1f}s")

    def _poll(self, sock: socket.socket, plan: _Plan) -> None:
        """Between pieces: a slot decode named is kept; a nack or abort stops the send (H5)."""
        while _readable(sock, 0.0):
            self._take_slot(sidechannel.recv_message(sock, self.config.transfer_timeout_s), plan)

    def _take_slot(self, message: Message, plan: _Plan) -> None:
        if message["type"] != "slot":
            raise sidechannel.unexpected(_quoted(message), "slot")
        slot = parse(Slot, message)
        if slot.index >= len(chunk_ranges(plan.count, plan.chunk_blocks)) or len(plan.slots) > 1024:
            raise TransferFailed(f"decode named a staging slot for chunk {slot.index}, which is not due")
        plan.slots[slot.index] = slot.addr

    def _slot(self, sock: socket.socket, plan: _Plan, index: int) -> int:
        """Where decode stages chunk `index`: named in the accept, or later, once decode has room."""
        while index not in plan.slots:
            self._take_slot(sidechannel.recv_message(sock, self.config.transfer_timeout_s), plan)
        return plan.slots.pop(index)

    def _prepare(
        self,
        index: int,
        blocks: Sequence[int],
        first: int,
        plan: _Plan,
        writer: _ChunkWriter,
        sock: socket.socket,
    ) -> _Chunk:
        """Chunk `index` encoded; on a one-sided transport its finished pieces already went to `writer`."""
        if plan.zero_copy:
            return self._prepare_in_place(index, blocks, first, plan, writer, sock)
        shape = self.kv.batch_shape(len(blocks), plan.heads)
        groups = self.kv.groups(plan.heads)
        nbytes = codec.payload_nbytes(self.codec, self.kv.dtype, shape, groups)
        remote = self._slot(sock, plan, index) if self.transport.one_sided else 0
        staged = self.staging.reserve(nbytes, self.config.transfer_timeout_s)
        if not self.transport.one_sided:  # announced first, then sent whole: no pieces
            pieces = None
        else:
            poll = functools.partial(self._poll, sock, plan)
            pieces = _PieceStream(self, writer, index, staged.data_ptr(), remote, poll)
        try:
            # none from host memory: each layer is gathered straight into its place in the payload
            host_none = self.codec is Compression.NONE and self.kv.device.type == "cpu"
            in_place = staged if host_none else None
            parts = self.kv.gather_layers(blocks, plan.heads, out=in_place)
            on_part = None if pieces is None else pieces.add
            header, payload = codec.encode_parts(
                parts, shape, self.kv.dtype, self.codec, groups, out=staged, on_part=on_part
            )
        except BaseException:
            if pieces is not None and pieces.sent:  # the writer may still be reading it
                with contextlib.suppress(Exception):
                    writer.put(_Release(staged))
            else:
                self.staging.release(staged)
            raise
        if pieces is None:  # two-sided: only the size counts
            return _Chunk(index, header, [payload], [Span(0, nbytes)], staged)
        src, dst = pieces.rest()
        return _Chunk(index, header, src, dst, staged)

    def _prepare_in_place(
        self,
        index: int,
        blocks: Sequence[int],
        first: int,
        plan: _Plan,
        writer: _ChunkWriter,
        sock: socket.socket,
    ) -> _Chunk:
        """Codec none, zero-copy: hash and write the blocks' spans a few layers at a time."""
        src = self.kv.spans(blocks, plan.heads)
        per_block = len(src) // len(blocks)
        theirs = plan.dst[first * per_block : (first + len(blocks)) * per_block]
        sizes_differ = any(span.nbytes != n for span, (_, n) in zip(theirs, src, strict=False))
        if len(theirs) != len(src) or sizes_differ:
            raise TransferFailed(f"decode's block spans for chunk {index} do not match this cache's")
        dst = [(span.addr, span.nbytes) for span in theirs]
        running = RunningChecksum()
        # Spans are in layer order, the same bytes for every layer: a piece is whole layers, as
        # few as make zero_copy_piece_bytes (the last piece takes what is left).
        per_layer = len(src) // self.kv.num_layers
        layer_bytes = sum(nbytes for _, nbytes in src[:per_layer])
        step = per_layer * max(1, -(-self.zero_copy_piece_bytes // layer_bytes))
        for start in range(0, len(src), step):
            self._poll(sock, plan)
            stop = min(start + step, len(src))
            for addr, nbytes in src[start:stop]:
                running.add(addr, nbytes)
            merged_src, merged_dst = coalesce(src[start:stop], dst[start:stop])
            piece = _Piece([Span(*s) for s in merged_src], [Span(*d) for d in merged_dst], index)
            self._before_write(index, piece.src)
            writer.put(piece)
        shape = self.kv.batch_shape(len(blocks), plan.heads)
        header = codec.KVHeader(Compression.NONE, self.kv.dtype_name, shape, 1, running.value)
        return _Chunk(index, header, [], [], None)

    def _before_write(self, index: int, src: Sequence[Source]) -> None:
        """Hook between checksum and write (tests corrupt the payload here)."""

    def close(self, timeout: float | None = None) -> bool:
        """Stop taking sends and unregister the memory only once no send can write from it (M4).

        Sends still waiting for decode's accept (nothing written yet) end now; sends moving KV run
        to their end. False (the memory stays registered) if one still runs after `timeout`
        (default: the hold plus two transfer timeouts).
        """
        self._closing.set()
        if timeout is None:
            timeout = self.config.hold_s + 2 * self.config.transfer_timeout_s
        if not self.wait_idle(timeout):
            _log.error("KV sends %s still running at close: their memory stays registered", self.in_flight)
            return False
        self._unregister()
        return True


def _chunk_blocks(offer: Offer, count: int) -> int:
    """Blocks per chunk of a part of `count` blocks: the offer's, which may exceed the count (one
    chunk; older senders offer their threshold), never below 1."""
    return max(1, min(offer.chunk_blocks, count))


_M = TypeVar("_M", Accept, Chunk, EndTransfer, Offer, Piece, Slot)


def parse(model: type[_M], message: Message) -> _M:
    """A peer's message as `model`; TransportError (the transfer ends) when it does not fit."""
    try:
        return parse_message(model, message)
    except MalformedMessage as error:
        raise TransportError(str(error)) from None


def _quoted(message: Message) -> Message:
    """What of a peer's message an error may repeat: its type and reason, bounded (L2)."""
    return {"type": bounded(message["type"], 20), "reason": bounded(message.get("reason", message["type"]))}


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer sent something (or closed) within `timeout` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(max(0, int(timeout * 1000))))


def _naming_rank(error: Exception, rank: int) -> Exception:
    """The same kind of error, its message prefixed with the decode rank it came from."""
    try:
        return type(error)(f"to decode TP rank {rank}: {error}")
    except TypeError:
        return error


def _catching(
    send: Callable[[SendJob, _Target], None], errors: dict[int, Exception], rank: int
) -> Callable[[SendJob, _Target], None]:
    """`send`, with its error kept under the decode rank (re-raised by the thread that waits)."""

    def run(job: SendJob, target: _Target) -> None:
        try:
            send(job, target)
        except Exception as error:  # noqa: BLE001 - handed to the waiting thread, which raises it
            errors[rank] = error

    return run


# ---- receiver -------------------------------------------------------------------------------------


class _LayerStream:
    """A staged chunk decoded and placed a few layers at a time, as its pieces arrive.

    A decode error stops the placing; it is raised at `finish`, once the chunk's messages were all
    read, so the side channel stays in step. The places hold unverified KV until `finish`
    verified the checksum; if it raises, the load fails and reports those blocks.
    """

    def __init__(
        self,
        kv: PagedKV,
        draft: codec.KVHeader,
        view: torch.Tensor,
        blocks: Sequence[int],
        heads: HeadRange | None,
        failed: Callable[[], str],
    ) -> None:
        self._kv, self._draft, self._blocks, self._heads = kv, draft, blocks, heads
        self._failed = failed  # the expectation's failure: once set, nothing more is placed (H5)
        self._error: Exception | None = None
        try:
            self._decode = codec.StreamingDecode(draft, view, kv.num_layers)
        except codec.CodecError as error:  # raised at `finish`, once the chunk's messages were read
            self._error = error

    def place_until(self, layers: int) -> None:
        if self._error is None and self._failed():
            self._error = TransferFailed(f"the load failed elsewhere: {self._failed()}")
        if self._error is not None:
            return
        try:
            done = self._decode.decoded
            parts = self._decode.parts_until(layers)
            self._kv.scatter_layers(self._blocks, parts, self._heads, layers=range(done, layers))
        except (codec.CodecError, LayoutError) as error:
            self._error = error

    def finish(self, header: codec.KVHeader) -> None:
        """The rest of the chunk placed, then the whole of it verified against its header."""
        _check_header(header, self._draft)
        self.place_until(self._kv.num_layers)
        if self._error is not None:
            raise self._error
        self._decode.verify(header.checksum)


@dataclass
class _Expectation:
    """A load decode waits for: from each prefill rank in `senders`, the model heads it sends.

    It ends once, when every sender's part is loaded, or when one failed (or none came in time) and
    no part is still being written.
    """

    transfer_id: str
    block_ids: tuple[int, ...]
    skip: int
    prompt_hash: str
    deadline: float
    prefill_tp: int = 1
    senders: dict[int, HeadRange | None] = field(default_factory=lambda: {0: None})
    claimed: set[int] = field(default_factory=set)  # prefill ranks whose offer was accepted
    active: set[int] = field(default_factory=set)  # claimed and not ended yet
    loaded: set[int] = field(default_factory=set)
    failure: str = ""
    timed_out: bool = False

    @property
    def waiting(self) -> bool:
        """Some sender has not offered yet (the prefill wait applies)."""
        return not self.failure and len(self.claimed) < len(self.senders)


@dataclass(eq=False)
class _Part:
    """One prefill rank's share of an expectation, claimed by its offer."""

    expectation: _Expectation
    prefill_rank: int
    heads: HeadRange | None  # this rank's heads that arrive; None: all of them
    told_to_stop: bool = False  # decode nacked mid-stream; the sender's done or abort is awaited


def _check_header(header: codec.KVHeader, draft: codec.KVHeader) -> None:
    """A chunk's header must be the one decode worked out from its own layout (H6): a peer's
    codec, dtype, groups or shape never choose how decode reads its memory."""
    if replace(header, checksum=0) != draft:
        theirs = bounded(header.to_dict() | {"checksum": None})
        raise TransferFailed(f"KV chunk header {theirs} does not match this cache's layout")


@contextlib.contextmanager
def _nack_on_error(sock: socket.socket) -> Iterator[None]:
    """Before the accept: a failure is told to the sender (best effort, bounded: L2), then raised."""
    try:
        yield
    except Exception as error:
        _send_nack(sock, f"KV load failed: {getattr(error, 'peer_reason', error)}")
        raise


def _send_nack(sock: socket.socket, reason: str) -> None:
    with contextlib.suppress(TransportError):
        sidechannel.send_message(sock, {"type": "nack", "reason": bounded(reason)})


class StagingWindow:
    """Decode's staging for one transfer's chunks on a one-sided transport.

    Where the whole payload fits the buffer it is one reservation, and every slot is named up
    front. Where it does not, the chunks go through a window of at most half the buffer (at least
    one chunk): each chunk's slot is freed once it is decoded, and later chunks' slots are reserved
    and named to the sender, which waits for them (back-pressure inside one transfer). A window only
    waits for room while it holds no slot, so transfers sharing the buffer cannot deadlock: whoever
    holds slots is being written and will free them.
    """

    def __init__(self, staging: StagingBuffer, sizes: Sequence[int], timeout: float) -> None:
        self._staging, self._sizes, self._timeout = staging, list(sizes), timeout
        self._views: dict[int, torch.Tensor] = {}
        self._whole: torch.Tensor | None = None
        self._next = 0  # the first chunk without a slot
        offsets = _chunk_offsets(sizes)
        if offsets[-1] <= staging.capacity:
            self._whole = staging.reserve(offsets[-1], timeout)
            self._views = {i: self._whole[offsets[i] : offsets[i] + n] for i, n in enumerate(sizes)}
            self._next = len(sizes)
        else:
            self._wait_for_next()
            self._fill()

    def slots(self) -> list[tuple[int, int]]:
        """(chunk index, address) of every slot reserved so far."""
        return [(index, view.data_ptr()) for index, view in sorted(self._views.items())]

    def view(self, index: int) -> torch.Tensor:
        return self._views[index]

    def decoded(self, index: int) -> list[tuple[int, int]]:
        """Chunk `index` is done with: in a window, free its slot; the slots newly reserved."""
        if self._whole is not None:
            return []
        self._staging.release(self._views.pop(index))
        new = [self._wait_for_next()] if not self._views and self._next < len(self._sizes) else []
        return new + self._fill()

    def _wait_for_next(self) -> tuple[int, int]:
        """Reserve the next chunk's slot, waiting for room (only while holding none)."""
        index = self._next
        self._views[index] = self._staging.reserve(self._sizes[index], self._timeout)
        self._next += 1
        return index, self._views[index].data_ptr()

    def _fill(self) -> list[tuple[int, int]]:
        """Reserve further slots while the window has room and so does the buffer, now."""
        new = []
        held = sum(view.numel() for view in self._views.values())
        while self._next < len(self._sizes) and held + self._sizes[self._next] <= self._staging.capacity // 2:
            view = self._staging.try_reserve(self._sizes[self._next])
            if view is None:
                break
            self._views[self._next] = view
            new.append((self._next, view.data_ptr()))
            held += view.numel()
            self._next += 1
        return new

    def release(self) -> None:
        if self._whole is not None:
            self._staging.release(self._whole)
        else:
            for view in self._views.values():
                self._staging.release(view)
        self._whole, self._views = None, {}


class KVReceiver(_PipeSide):
    """Decode side: serves the side channel and loads offered KV into expected blocks."""

    def __init__(
        self,
        transport: Transport,
        kv: PagedKV,
        config: PipeConfig,
        host: str,
        port: int,
        *,
        engine_id: str | None = None,
        auth: sidechannel.PeerAuth | None = None,
    ) -> None:
        super().__init__(transport, kv, config)
        self.engine_id = engine_id
        self._cond = threading.Condition()
        self._expected: dict[str, _Expectation] = {}
        self._results: dict[str, str] = {}  # transfer id -> "" loaded, else reason
        # Ended transfers (the latest 1000): a late part's offer is refused at once, not held.
        self._ended: dict[str, None] = {}
        self._server = sidechannel.Server(host, port, self._serve, auth=auth)

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def pending(self) -> set[str]:
        with self._cond:
            return set(self._expected)

    def expect(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        *,
        skip: int = 0,
        prompt_hash: str = "",
        prefill_tp_size: int | None = None,
    ) -> None:
        """Decode allocated `block_ids` for this transfer's blocks from index `skip` on.

        `prefill_tp_size` (None: this engine's own) says which prefill ranks send parts of it.
        """
        self.kv.check_ids(block_ids)
        prefill_tp = prefill_tp_size or self.kv.tp.size
        senders = self._senders(prefill_tp)
        deadline = time.monotonic() + self.config.prefill_wait_s
        with self._cond:
            if transfer_id in self._expected or transfer_id in self._results:
                raise TransferFailed(f"transfer {transfer_id} is already expected")
            self._expected[transfer_id] = _Expectation(
                transfer_id, tuple(block_ids), skip, prompt_hash, deadline, prefill_tp, senders
            )
            self._ended.pop(transfer_id, None)
            self._cond.notify_all()

    def _senders(self, prefill_tp: int) -> dict[int, HeadRange | None]:
        own = self.kv.tp
        if prefill_tp == own.size:
            return {own.rank: None}
        mapping = plan_tp_mapping(self.kv.geometry.model_kv_heads, prefill_tp, own.size)
        return dict(mapping.senders_to(own.rank))

    def cancel(self, transfer_id: str) -> None:
        """Abort: the expectation fails, and ends once no part writes into its blocks any more (H5).

        Parts under way are told to stop (their senders answer abort); until then `results()` does
        not report it, so vLLM cannot hand its blocks to another request. A later offer is refused.
        """
        with self._cond:
            expectation = self._expected.get(transfer_id)
            if expectation is None:
                return
            if not expectation.failure:
                expectation.failure = "cancelled by decode"
            self._settle_locked(expectation)

    def results(self) -> dict[str, str]:
        """Expectations that ended since the last call: id -> "" when loaded, else the failure reason."""
        self._expire_unclaimed()
        with self._cond:
            done, self._results = self._results, {}
        return done

    def wait_for(self, transfer_id: str, timeout: float) -> str | None:
        """Block until this transfer ends (its outcome, consumed) or timeout (None)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire_unclaimed_locked()
                if transfer_id in self._results:
                    return self._results.pop(transfer_id)
                left = min(deadline, self._next_deadline()) - time.monotonic()
                if time.monotonic() >= deadline:
                    return None
                self._cond.wait(max(0.001, left))

    def wait_settled(self, transfer_id: str, timeout: float) -> bool:
        """Block until this transfer has ended, without consuming its outcome."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire_unclaimed_locked()
                if transfer_id in self._results:
                    return True
                left = min(deadline, self._next_deadline()) - time.monotonic()
                if time.monotonic() >= deadline:
                    return False
                self._cond.wait(max(0.001, left))

    def _next_deadline(self) -> float:
        unclaimed = [e.deadline for e in self._expected.values() if e.waiting]
        return min(unclaimed, default=time.monotonic() + 1.0)

    def _expire_unclaimed(self) -> None:
        with self._cond:
            self._expire_unclaimed_locked()

    def _expire_unclaimed_locked(self) -> None:
        now = time.monotonic()
        for expectation in list(self._expected.values()):
            if expectation.waiting and now >= expectation.deadline:
                expectation.failure = self._nothing_sent(expectation)
                expectation.timed_out = True
                self._settle_locked(expectation)

    def _nothing_sent(self, expectation: _Expectation) -> str:
        wait = f"{self.config.prefill_wait_s:.1f}s"
        if len(expectation.senders) == 1 and not expectation.claimed:
            return f"prefill sent nothing within {wait}"
        missing = sorted(set(expectation.senders) - expectation.claimed)
        return f"prefill TP ranks {missing} of {expectation.prefill_tp} sent nothing within {wait}"

    def _end(self, transfer_id: str, part: _Part | None, reason: str, *, timed_out: bool = False) -> None:
        """A part ended (or an offer failed before claiming one): settle its expectation."""
        with self._cond:
            expectation = self._expected.get(transfer_id)
            if expectation is None or (part is not None and part.expectation is not expectation):
                return
            if part is not None:
                expectation.active.discard(part.prefill_rank)
                if not reason:
                    expectation.loaded.add(part.prefill_rank)
            if reason and not expectation.failure:
                expectation.failure, expectation.timed_out = reason, timed_out
            self._settle_locked(expectation)

    def _settle_locked(self, expectation: _Expectation) -> None:
        """End the expectation once nothing writes into its blocks any more and the outcome is known."""
        if expectation.active:
            return
        if expectation.failure:
            self._finish_locked(expectation.transfer_id, expectation.failure, timed_out=expectation.timed_out)
        elif expectation.loaded == set(expectation.senders):
            self._finish_locked(expectation.transfer_id, "")

    def _finish_locked(self, transfer_id: str, reason: str, *, timed_out: bool = False) -> None:
        expectation = self._expected.pop(transfer_id, None)
        if expectation is None:
            return
        expectation.failure = expectation.failure or reason  # parts still streaming stop loading
        self._results[transfer_id] = reason
        self._ended[transfer_id] = None
        while len(self._ended) > 1000:
            del self._ended[next(iter(self._ended))]
        if reason:
            self.stats.failed_receives += 1
            self.stats.timeouts += timed_out
        else:
            self.stats.received += 1
        self._cond.notify_all()

    # side channel ------------------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        """One prefill connection: an offer and its transfer, or an `end` (M2). Whatever the peer
        sends or whatever breaks, the part it claimed ends with a reason (H6)."""
        try:
            first = sidechannel.recv_message(sock, self.config.transfer_timeout_s)
            if first["type"] == "end":
                self._end_id(parse(EndTransfer, first).transfer_id)
                sidechannel.send_message(sock, {"type": "ack"})
                return
            if first["type"] != "offer":
                raise sidechannel.unexpected(_quoted(first), "offer")
            offer = parse(Offer, first)
            if isinstance(self.transport, TorchDistTransport):  # M7: only the peer's own store
                self.transport.admit(offer.endpoint, sock.getpeername()[0])
        except Exception as error:  # noqa: BLE001 - nothing was claimed: told and logged, bounded
            _send_nack(sock, f"KV load failed: {error}")
            _log.warning("KV side-channel peer refused: %s", bounded(str(error)))
            return
        part: _Part | None = None
        try:
            with _nack_on_error(sock):
                part = self._check_offer(offer)
            self._receive(sock, offer, part)
        except Exception as error:  # noqa: BLE001 - every failure ends the part with its reason
            reason = bounded(f"KV load failed: {error}")
            self.stats.checksum_failures += isinstance(error, codec.ChecksumError)
            unexpected = not isinstance(error, _EXPECTED_ERRORS)
            _log.warning("KV receive %s failed: %s", offer.transfer_id, reason, exc_info=unexpected)
            self._end(offer.transfer_id, part, reason, timed_out=isinstance(error, TransferTimeout))

    def _end_id(self, transfer_id: str) -> None:
        """Decode will never expect this id: a waiting or later offer for it is refused at once."""
        with self._cond:
            if transfer_id in self._expected:
                return  # decode's own expectation wins over a peer's word
            self._ended[transfer_id] = None
            while len(self._ended) > 1000:
                del self._ended[next(iter(self._ended))]
            self._cond.notify_all()

    def _receive(self, sock: socket.socket, offer: Offer, part: _Part) -> None:
        expectation, heads = part.expectation, part.heads
        with _nack_on_error(sock):
            window, dst, sizes = self._reserve(offer, part)
        count = len(expectation.block_ids)
        chunks = chunk_ranges(count, _chunk_blocks(offer, count))
        failure: Exception | None = None
        try:
            endpoint = self.transport.endpoint() if self.transport.one_sided else {}
            accept = {
                "type": "accept",
                "skip": expectation.skip,
                "count": count,
                "dst": dst,
                "slots": [] if window is None else window.slots(),
                "endpoint": endpoint,
            }
            sidechannel.send_message(sock, accept)
            try:
                for index, (a, b) in enumerate(chunks):
                    blocks = expectation.block_ids[a:b]
                    own: torch.Tensor | None = None
                    if window is not None:
                        view: torch.Tensor | None = window.view(index)
                    elif not self.transport.one_sided:  # two-sided: one batch of staging at a time
                        view = own = self.staging.reserve(sizes[index], self.config.transfer_timeout_s)
                    else:
                        view = None
                    load = failure is None and not expectation.failure
                    try:
                        self._receive_chunk(sock, offer, index, blocks, view, part, load=load)
                    except TransportError as error:
                        if not isinstance(error, TransferFailed):  # the channel itself broke
                            raise
                        failure = failure or error
                    except Exception as error:  # noqa: BLE001 - any failure: the sender is told to stop
                        failure = failure or error  # and the rest is consumed, so nothing writes after
                    finally:
                        if own is not None:
                            self.staging.release(own)
                    if failure is not None:
                        self._tell_to_stop(sock, part, f"KV load failed: {failure}")
                    for slot, addr in [] if window is None else window.decoded(index):
                        sidechannel.send_message(sock, {"type": "slot", "index": slot, "addr": addr})
                if (last := self._next_message(sock, part))["type"] != "done":
                    raise sidechannel.unexpected(_quoted(last), "done")
                if failure is None and expectation.failure:
                    failure = TransferFailed(f"the load failed elsewhere: {expectation.failure}")
            except TransportError as error:
                self._refuse_and_drain(
                    sock,
                    f"KV load failed: {error}",
                    drain=not isinstance(error, PeerRefused),
                    slow=isinstance(error, TransferTimeout),
                )
                if failure is not None:  # the sender stopped because decode told it why
                    raise failure from None
                raise
            if failure is not None:
                self._refuse_and_drain(sock, f"KV load failed: {failure}", drain=False)
                raise failure
        finally:
            if window is not None:
                window.release()
        self.stats.bytes_on_wire += sum(sizes)
        self.stats.raw_bytes += self.kv.batch_nbytes(count, heads)
        self._end(expectation.transfer_id, part, "")
        sidechannel.send_message(sock, {"type": "ack"})

    def _tell_to_stop(self, sock: socket.socket, part: _Part, reason: str) -> None:
        """Mid-stream, once: nack now, so the sender stops writing and answers with abort (H5)."""
        if not part.told_to_stop:
            part.told_to_stop = True
            _send_nack(sock, reason)
            self.stats.stops_requested += 1

    def _reserve(
        self, offer: Offer, part: _Part
    ) -> tuple[StagingWindow | None, list[tuple[int, int]], list[int]]:
        """Name where each chunk of this part goes: decode's block spans (zero-copy), or staging
        (one-sided: a window of it, the first slots named in the accept), or nothing (two-sided)."""
        block_ids, heads = part.expectation.block_ids, part.heads
        chunks = chunk_ranges(len(block_ids), _chunk_blocks(offer, len(block_ids)))
        groups = self.kv.groups(heads)
        sizes = [
            codec.payload_nbytes(offer.codec, self.kv.dtype, self.kv.batch_shape(b - a, heads), groups)
            for a, b in chunks
        ]
        if offer.zero_copy and self.transport.one_sided:
            spans = [span for a, b in chunks for span in self.kv.spans(block_ids[a:b], heads)]
            return None, spans, sizes
        self.staging.check_fits(max(sizes))  # refused before the accept, whichever the transport
        if not self.transport.one_sided:  # the sender needs no addresses; batches reserve as they come
            return None, [], sizes
        return StagingWindow(self.staging, sizes, self.config.transfer_timeout_s), [], sizes

    def _check_offer(self, offer: Offer) -> _Part:
        """Compare the caches, then claim the sender's part of the expectation it names."""
        mismatches = signature_mismatches(self.kv.signature(), offer.signature)
        if mismatches:
            # L2: decode's outcome and log have both sides (bounded); the peer learns only which
            # fields differ, never decode's values
            keys = sorted({line.split(":", 1)[0] for line in mismatches})
            raise _RefusedWithDetail(
                "KV cache mismatch between prefill and decode: " + bounded("; ".join(mismatches)),
                "KV cache mismatch between prefill and decode in: " + bounded(", ".join(keys)),
            )
        hold = min(offer.hold_s or self.config.hold_s, self.config.hold_s)  # H4: never the peer's longer one
        return self._claim(offer, hold)

    def _check_claim(self, offer: Offer, expectation: _Expectation) -> _Part:
        """The offer fits what decode expects (engine, prompt, blocks, TP rank and heads): its part."""
        wanted_engine = offer.engine_id
        if wanted_engine and self.engine_id and wanted_engine != self.engine_id:
            raise TransferFailed(
                f"prefill was sent to decode engine {bounded(wanted_engine)!r}, this is {self.engine_id!r}"
            )
        if offer.prompt_hash != expectation.prompt_hash:  # L3: never skipped
            raise TransferFailed("prompt token ids differ between prefill and decode (tokenization mismatch)")
        count = len(expectation.block_ids)
        if expectation.skip + count > offer.num_blocks:
            raise TransferFailed(
                f"decode wants {count} blocks after {expectation.skip}, prefill has {offer.num_blocks}"
            )
        rank, heads = self._check_tp(offer, expectation)
        if expectation.failure or rank in expectation.claimed:
            raise TransferFailed(f"transfer {expectation.transfer_id} is not awaited any more")
        return _Part(expectation, rank, None if heads is None else self.kv.local_heads(heads))

    def _check_tp(self, offer: Offer, expectation: _Expectation) -> tuple[int, HeadRange | None]:
        """The offering prefill rank and the model heads it sends, as decode's TP mapping wants them."""
        own, tp = self.kv.tp, offer.tp
        rank, size = tp.rank, tp.size
        decode_rank = rank if tp.decode_rank is None else tp.decode_rank
        heads = tp.heads
        if size != expectation.prefill_tp:
            raise TransferFailed(
                f"prefill TP size {size} offered, decode (TP {own.size}) expects prefill TP "
                f"{expectation.prefill_tp} for this request"
            )
        if decode_rank != own.rank:
            raise TransferFailed(
                f"prefill TP rank {rank} addressed decode TP rank {decode_rank}, this is rank {own.rank}"
            )
        if rank not in expectation.senders or expectation.senders[rank] != heads:
            wanted = expectation.senders.get(rank, "no heads")
            raise TransferFailed(
                f"prefill TP rank {rank} of {size} offered KV heads {heads}, decode TP rank {own.rank} "
                f"of {own.size} wants {wanted} from it"
            )
        return rank, heads

    def _receive_chunk(
        self,
        sock: socket.socket,
        offer: Offer,
        index: int,
        blocks: Sequence[int],
        view: torch.Tensor | None,
        part: _Part,
        *,
        load: bool,
    ) -> None:
        """Take chunk `index` in; with load false (an earlier chunk failed) only consume it."""
        heads, expectation = part.heads, part.expectation
        draft = self._draft_header(offer, blocks, heads, staged=view is not None)
        stream = None
        if load and view is not None and self.transport.one_sided:
            stream = _LayerStream(self.kv, draft, view, blocks, heads, lambda: expectation.failure)
        announced = self._chunk_message(sock, index, stream, part)
        header = codec.KVHeader.from_dict(announced.header)
        if load:
            _check_header(header, draft)
        if view is not None and not self.transport.one_sided:
            peer = dict(offer.endpoint)
            try:
                self.transport.recv(peer, [view], offer.tag, self.config.transfer_timeout_s)
            except TransportError:
                self.transport.forget_peer(peer)
                raise
        if not load:
            return
        if view is None:
            actual = spans_checksum(self.kv.spans(blocks, heads))
            if actual != header.checksum:
                raise codec.ChecksumError(f"KV checksum {actual:#018x} != sender's {header.checksum:#018x}")
            return
        if stream is None:  # two-sided: the whole chunk arrived at once
            if expectation.failure:  # cancelled while it was on the wire: not placed (H5)
                raise TransferFailed(f"the load failed elsewhere: {expectation.failure}")
            self.kv.scatter_layers(blocks, codec.decode_parts(header, view, self.kv.num_layers), heads)
            return
        stream.finish(header)

    def _draft_header(
        self, offer: Offer, blocks: Sequence[int], heads: HeadRange | None, *, staged: bool = True
    ) -> codec.KVHeader:
        """The header a chunk of `blocks` will carry, but for its checksum (known at its end).
        Zero-copy chunks (not staged) are raw blocks: codec none, one group."""
        shape = self.kv.batch_shape(len(blocks), heads)
        if not staged:
            return codec.KVHeader(Compression.NONE, self.kv.dtype_name, shape, 1, 0)
        return codec.KVHeader(offer.codec, self.kv.dtype_name, shape, self.kv.groups(heads), 0)

    def _chunk_message(
        self, sock: socket.socket, index: int, stream: _LayerStream | None, part: _Part
    ) -> Chunk:
        """The announcement of chunk `index`, placing the layers its pieces bring on the way."""
        while True:
            message = self._next_message(sock, part)
            if message["type"] not in ("piece", "chunk"):
                raise sidechannel.unexpected(_quoted(message), "chunk")
            if message["type"] == "chunk":
                chunk = parse(Chunk, message)
                if chunk.index != index:
                    raise TransferFailed(f"chunk {chunk.index} arrived where chunk {index} was due")
                return chunk
            piece = parse(Piece, message)
            if piece.index != index or piece.parts > self.kv.num_layers:
                raise TransferFailed(f"a piece of chunk {piece.index} arrived where chunk {index} was due")
            if stream is not None:
                stream.place_until(piece.parts)

    def _next_message(self, sock: socket.socket, part: _Part) -> Message:
        """The sender's next message (within the transfer timeout). A failure of the load (a cancel,
        another part) is told to the sender before each message and while waiting, so that it stops
        writing into decode's memory at once (H5)."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            if part.expectation.failure:
                self._tell_to_stop(sock, part, f"KV load failed: {part.expectation.failure}")
            if _readable(sock, min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                return sidechannel.recv_message(sock, self.config.transfer_timeout_s)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"no side-channel message within {self.config.transfer_timeout_s:.1f}s")

    def _refuse_and_drain(self, sock: socket.socket, reason: str, *, drain: bool, slow: bool = False) -> None:
        """Tell the sender; if it may still be writing, wait until it says it stopped (done or
        abort) or closes before decode's memory is handed on (H5). A sender that went quiet
        (`slow`: a write may hang in its transport) gets up to the hold time; one that broke the
        protocol, the transfer timeout."""
        _send_nack(sock, reason)
        if not drain:
            return
        wait = (
            max(self.config.hold_s, self.config.transfer_timeout_s)
            if slow
            else self.config.transfer_timeout_s
        )
        deadline = time.monotonic() + wait
        with contextlib.suppress(TransportError):
            while (left := deadline - time.monotonic()) > 0:
                if sidechannel.recv_message(sock, left)["type"] in ("done", "abort"):
                    return

    def _claim(self, offer: Offer, hold_s: float) -> _Part:
        """Wait (up to the hold) until decode expects this id, then own the sender's part."""
        transfer_id = offer.transfer_id
        deadline = time.monotonic() + hold_s
        with self._cond:
            while True:
                self._expire_unclaimed_locked()
                expectation = self._expected.get(transfer_id)
                if expectation is not None:
                    part = self._check_claim(offer, expectation)
                    expectation.claimed.add(part.prefill_rank)
                    expectation.active.add(part.prefill_rank)
                    return part
                if transfer_id in self._results or transfer_id in self._ended:
                    raise TransferFailed(f"transfer {transfer_id} is not awaited any more")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"decode did not claim transfer {transfer_id} within {hold_s:.1f}s")
                self._cond.wait(min(left, 1.0))

    def close(self, timeout: float | None = None) -> bool:
        """Fail every load, tell the senders of parts under way to stop, and unregister the memory
        once none writes into it (H5, M4). False (the memory stays registered) if a part is still
        active after `timeout` (default: three transfer timeouts)."""
        self._server.close()
        wait = 3 * self.config.transfer_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            for expectation in list(self._expected.values()):
                expectation.failure = expectation.failure or "receiver closed"
                self._settle_locked(expectation)
            while (active := {e.transfer_id for e in self._expected.values() if e.active}) and (
                left := deadline - time.monotonic()
            ) > 0:
                self._cond.wait(min(left, _POLL_S * 10))
            for transfer_id in list(self._expected):
                self._finish_locked(transfer_id, "receiver closed")
        if active:
            _log.error("KV loads %s still written at close: their memory stays registered", sorted(active))
            return False
        self._unregister()
        return True


# ---- the seed's tensor API ------------------------------------------------------------------------


class KVPipe:
    """send_kv_cache(request_id, kv, metadata) -> bool and receive_kv_cache(request_id, timeout).

    A whole KV tensor (any shape; its leading axis counts as blocks) moves as one transfer, keyed by
    request id. The receiving end is made for a tensor like the ones it will receive.
    """

    def __init__(self, transport: Transport, config: PipeConfig, *, host: str, port: int) -> None:
        self.transport = transport
        self.config = config
        self.host = host
        self.port = port

    def send_kv_cache(self, request_id: str, kv: torch.Tensor, metadata: Mapping[str, Any]) -> bool:
        """Push `kv` to metadata's peer ({"host", "port"}); True once decode verified and loaded it."""
        paged = _single_tensor_kv(kv)
        shape = paged.batch_shape(kv.shape[0])
        staging = codec.payload_nbytes(self.config.compression, kv.dtype, shape, paged.layout.groups)
        config = replace(self.config, async_transfer=False, buffer_bytes=staging + 64)
        sender = KVSender(self.transport, paged, config)
        job = SendJob(request_id, tuple(range(kv.shape[0])), str(metadata["host"]), int(metadata["port"]))
        try:
            sender.submit(job)
        finally:
            sender.close()
        return sender.finished().get(request_id, "missing") is None

    def receiver_for(self, like: torch.Tensor) -> _TensorReceiver:
        return _TensorReceiver(self, like)


class _TensorReceiver:
    """Decode end of KVPipe: receive_kv_cache(request_id, timeout) -> tensor or None."""

    def __init__(self, pipe: KVPipe, like: torch.Tensor) -> None:
        self.buffer = torch.empty_like(like)
        self.kv = _single_tensor_kv(self.buffer)
        self.receiver = KVReceiver(pipe.transport, self.kv, pipe.config, pipe.host, pipe.port)

    def receive_kv_cache(self, request_id: str, timeout: float) -> torch.Tensor | None:
        self.receiver.expect(request_id, range(self.buffer.shape[0]))
        outcome = self.receiver.wait_for(request_id, timeout)
        if outcome is None:
            self.receiver.cancel(request_id)
            self.receiver.wait_for(request_id, 0)  # consume the cancellation
            return None
        return self.buffer.clone() if outcome == "" else None

    def close(self) -> None:
        self.receiver.close()


def _single_tensor_kv(kv: torch.Tensor) -> PagedKV:
    return PagedKV({"kv": kv}, kv.shape[0], Geometry(block_size=0, num_kv_heads=0, head_dim=0))
