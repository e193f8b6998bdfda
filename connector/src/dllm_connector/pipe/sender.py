"""Prefill's side of a transfer: takes send jobs, offers each to every decode rank it feeds, keeps outcomes.

KVSender runs the jobs on threads, picks each one's decode ranks, connects and makes the offers;
rank_send carries one rank's exchange on from there, and chunk_encoder makes its chunks.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dllm_connector import codec
from dllm_connector.layout import HeadRange, PagedKV, plan_tp_mapping
from dllm_connector.pipe.chunk_encoder import Encoding
from dllm_connector.pipe.common import EXPECTED_ERRORS, PipeConfig, PipeSide, TransferFailed
from dllm_connector.pipe.messages import Offer, TPPart, bounded
from dllm_connector.pipe.rank_send import RankSend
from dllm_connector.pipe.side_request import connect_when_free
from dllm_connector.thread_device import on_device, settle
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import Source, TransferTimeout, Transport
from dllm_connector.transport.torchdist import TorchDistTransport
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)
# Codec none writes block to block only where each run of memory is at least this long. A head
# range on the NHD layout is one short run per token; those are gathered into staging instead
# (short runs move far slower zero-copy: docs/kv-connector.md, "Head ranges").
MIN_ZERO_COPY_RUN = 16 << 10
# A chunk goes on the wire in pieces of at least this much as it encodes: the wire starts on the
# first chunk without waiting for all of it, and the calls stay few (each transport write has a
# fixed cost: docs/kv-connector.md, "Pieces").
PIECE_BYTES = 8 << 20
# Zero-copy pieces are one Mooncake write per block span: fewer, larger pieces measured better
# (docs/kv-connector.md, "Pieces").
ZERO_COPY_PIECE_BYTES = 32 << 20


@dataclass(frozen=True)
class SendJob:
    transfer_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    prompt_hash: str = ""
    engine_id: str | None = None  # the decode engine the router named; checked at the handshake
    decode_tp_size: int | None = None  # None: the sender's own TP size (rank r sends to rank r)
    # when the job was made: the request ended at prefill and its blocks wait for this send
    made_at: float = field(default_factory=time.monotonic, compare=False)


@dataclass(frozen=True)
class _Target:
    """One decode rank a send goes to (at the job's port + its rank) and the model heads it gets."""

    decode_rank: int
    model_heads: HeadRange | None  # None: all of this rank's heads (equal TP sizes)


class KVSender(PipeSide):
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
            on_device(self.kv.device, self._run)(job)  # its own stream, even on vLLM's thread
            return
        thread = threading.Thread(
            target=on_device(self.kv.device, self._run),
            args=(job,),
            name=f"kv-send-{job.transfer_id}",
            daemon=True,
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
            try:
                self.send(job)
            finally:  # vLLM may free the job's blocks once its outcome is recorded
                settle(self.kv.device)
        except Exception as error:  # noqa: BLE001 - every failure ends the transfer with a reason
            reason = bounded(str(error) or type(error).__name__)
            self.stats.failed_sends += 1
            self.stats.timeouts += isinstance(error, TransferTimeout)
            unexpected = not isinstance(error, EXPECTED_ERRORS)
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
        """Codec none over a one-sided transport that holds the cache's memory (a host cache on the
        host path, any cache on the device path): block-to-block writes, no staging. Of the codec
        configured now (placement.zero_copy, of the codec at start, is what the worker reports)."""
        registered = self.placement.cache_registered
        return registered and self.codec is Compression.NONE and self.transport.one_sided

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
            threading.Thread(
                target=on_device(self.kv.device, _catching(self._send_to, errors, target.decode_rank)),
                args=(job, target),
            )
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
        heads = self.kv.part_heads(target.model_heads)
        host = self._allowed_address(job)
        started = time.monotonic()
        with self._connect(host, port) as sock:
            self.queued.add(time.monotonic() - job.made_at)
            offer = self._offer(job, target, port, heads)
            encoding = Encoding(self.codec, self.piece_bytes, self.zero_copy_piece_bytes, self._before_write)
            wire, raw = RankSend(self, sock, encoding, self._closing).run(offer, job.block_ids, heads)
        with self._lock:
            self.stats.sent += 1
            self.stats.bytes_on_wire += wire
            self.stats.raw_bytes += raw
        self.durations.add(time.monotonic() - started)

    def _allowed_address(self, job: SendJob) -> str:
        """The address to connect to for the job's decode peer (C1); TransferFailed if refused."""
        if self._peer_address is None:
            return job.host
        try:
            return self._peer_address(job.host, job.port)
        except Exception as error:  # noqa: BLE001 - any refusal or lookup failure ends this send
            raise TransferFailed(str(error)) from None

    def _connect(self, host: str, port: int) -> socket.socket:
        """A connection to the decode rank at host:port within the transfer timeout, retrying a side
        channel not up yet and one that is full; an authentication failure is final at once."""
        timeout = self.config.transfer_timeout_s
        sock = connect_when_free(
            host, port, timeout, auth=self._auth, stop=self._closing, retry_unreachable=True
        )
        sock.settimeout(timeout)  # each later step has its own transfer timeout, not what was left
        return sock

    def _chunk_blocks(self, count: int) -> int:
        """Blocks per chunk, at most the transfer's `count` (decode refuses more, L3)."""
        if self.kv.geometry.block_size > 0:
            per_chunk = -(-self.config.threshold_tokens // self.kv.geometry.block_size)
        else:
            block_bytes = len(self.kv.caches) * self.kv.layout.segments * self.kv.segment_nbytes
            per_chunk = self.config.chunk_bytes // max(1, block_bytes)
        return max(1, min(per_chunk, count))

    def _offer(self, job: SendJob, target: _Target, port: int, heads: HeadRange | None) -> Offer:
        """What this rank offers the decode rank `target` of the job (the first message on its connection)."""
        endpoint = self.transport.endpoint()
        if isinstance(self.transport, TorchDistTransport):
            endpoint["pair"] = self.transport.pair_key(job.host + f":{port}")
        # the sender's own values, not validated here: decode validates every offer it reads
        tp = TPPart.model_construct(
            rank=self.kv.tp.rank,
            size=self.kv.tp.size,
            decode_rank=target.decode_rank,
            heads=target.model_heads,
        )
        return Offer.model_construct(
            type="offer",
            transfer_id=job.transfer_id,
            prompt_hash=job.prompt_hash,
            engine_id=job.engine_id,
            num_blocks=len(job.block_ids),
            codec=self.codec,
            zero_copy=self._zero_copy_for(heads),
            chunk_blocks=self._chunk_blocks(len(job.block_ids)),
            signature=self.kv.signature(),
            endpoint=endpoint,
            hold_s=self.config.hold_s,
            tag=next(self._tags),
            tp=tp,
        )

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
