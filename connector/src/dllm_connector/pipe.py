"""KV pipes: a prefill-side sender and a decode-side receiver on codec + transport + side channel.

One transfer, keyed by the router's transfer id (never a vLLM request id):

    sender                                   receiver (decode worker, side channel on kv_port + rank)
    offer {id, cache signature, blocks} ->   checks the signature; waits (up to hold) for decode to
                                             expect the id; reserves staging or names its KV blocks
                                     <-      accept {skip, count, destination regions, tag}
    gathers + encodes [sending, if two-sided]
    transport writes                    ->   (two-sided transports receive here)
    done {KV header with checksum}      ->   verifies the checksum, decodes, scatters into blocks
                                     <-      ack, or nack {reason}

Codec none over a one-sided transport writes block to block with no staging copy; compressed KV
(and any two-sided transport) goes through the registered staging buffers. Every expectation ends
exactly once (loaded, failed, timed out or cancelled) and every staging reservation is released.

`KVPipe.send_kv_cache` / `receive_kv_cache` is the seed's tensor API on the same machinery.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from dllm_connector import codec
from dllm_connector.kv_layout import Geometry, LayoutError, PagedKV, regions_checksum, signature_mismatches
from dllm_connector.kv_scheduler import prompt_hash
from dllm_connector.kvconfig import Compression, ConnectorExtraConfig
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import RemoteRegion, TransferTimeout, Transport, TransportError
from dllm_connector.transport.staging import StagingBuffer
from dllm_connector.transport.torchdist import TorchDistTransport

__all__ = ["KVPipe", "KVReceiver", "KVSender", "PipeConfig", "SendJob", "TransferFailed", "prompt_hash"]

_log = logging.getLogger(__name__)
_GB = 1 << 30
# Connection attempts to a decode side channel that is not up yet are retried this often.
_CONNECT_RETRY_S = 0.05


@dataclass(frozen=True)
class PipeConfig:
    compression: Compression = Compression.NONE
    buffer_bytes: int = 1 << 28
    transfer_timeout_s: float = 5.0
    prefill_wait_s: float = 60.0
    hold_s: float = 480.0
    async_transfer: bool = True
    threshold_tokens: int = 1024

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
    bytes_on_wire: int = 0
    raw_bytes: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


class TransferFailed(TransportError):
    """A transfer ended without the KV in place; the message says why."""


# ---- sender ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendJob:
    transfer_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    prompt_hash: str = ""


@dataclass(frozen=True)
class _Plan:
    """What the receiver accepted: which blocks, and where they go."""

    skip: int
    count: int
    dst: list[RemoteRegion]
    tag: int
    peer: dict[str, Any]


class KVSender:
    """Prefill side. Sends run on their own threads when async; `finished()` drains the outcomes."""

    def __init__(self, transport: Transport, kv: PagedKV, config: PipeConfig) -> None:
        self.transport = transport
        self.kv = kv
        self.config = config
        self.stats = PipeStats()
        self.staging = StagingBuffer(config.buffer_bytes)
        transport.register(self.staging.tensor)
        kv.register_with(transport.register)
        self._tags = itertools.count(1)
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._done: dict[str, str | None] = {}  # transfer id -> None (sent) or the failure reason
        self._threads: list[threading.Thread] = []

    @property
    def in_flight(self) -> set[str]:
        with self._lock:
            return set(self._in_flight)

    def submit(self, job: SendJob) -> None:
        with self._lock:
            self._in_flight.add(job.transfer_id)
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
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not self.in_flight

    def _run(self, job: SendJob) -> None:
        reason: str | None = None
        try:
            self.send(job)
        except (TransportError, codec.CodecError, LayoutError) as error:
            reason = str(error)
            self.stats.failed_sends += 1
            self.stats.timeouts += isinstance(error, TransferTimeout)
            _log.warning("KV send %s failed: %s", job.transfer_id, reason)
        with self._lock:
            self._in_flight.discard(job.transfer_id)
            self._done[job.transfer_id] = reason

    def send(self, job: SendJob) -> None:
        """One blocking transfer; raises on any failure."""
        with self._connect(job) as sock:
            plan = self._offer(sock, job)
            blocks = job.block_ids[plan.skip : plan.skip + plan.count]
            staged: torch.Tensor | None = None
            try:
                header, src, staged = self._prepare_or_abort(sock, blocks, plan)
                self._before_write(src)
                if not self.transport.one_sided:  # the receiver posts its receive only now
                    sidechannel.send_message(sock, {"type": "sending"})
                try:
                    self.transport.send(plan.peer, src, plan.dst, plan.tag, self.config.transfer_timeout_s)
                except TransportError:
                    self.transport.forget_peer(plan.peer)
                    raise
                sidechannel.send_message(sock, {"type": "done", "header": header.to_dict()})
                sidechannel.expect(sock, "ack", self.config.transfer_timeout_s)
            finally:
                if staged is not None:
                    self.staging.release(staged)
        self.stats.sent += 1
        self.stats.bytes_on_wire += header.payload_nbytes
        self.stats.raw_bytes += header.raw_nbytes

    def _connect(self, job: SendJob) -> socket.socket:
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            try:
                return sidechannel.connect(job.host, job.port, self.config.transfer_timeout_s)
            except TransportError:
                if time.monotonic() + _CONNECT_RETRY_S > deadline:
                    raise
                time.sleep(_CONNECT_RETRY_S)

    def _offer(self, sock: socket.socket, job: SendJob) -> _Plan:
        endpoint = self.transport.endpoint()
        codec_used = codec.effective_codec(self.config.compression, self.kv.dtype)
        offer: dict[str, Any] = {
            "type": "offer",
            "transfer_id": job.transfer_id,
            "prompt_hash": job.prompt_hash,
            "num_blocks": len(job.block_ids),
            "codec": codec_used.value,
            "signature": self.kv.signature(),
            "endpoint": endpoint,
            "hold_s": self.config.hold_s,
            "tag": next(self._tags),
        }
        if isinstance(self.transport, TorchDistTransport):
            offer["endpoint"]["pair"] = self.transport.pair_key(job.host + f":{job.port}")
        sidechannel.send_message(sock, offer)
        reply = sidechannel.expect(sock, "accept", self.config.hold_s)
        peer = dict(reply.get("endpoint", {})) | {"pair": offer["endpoint"].get("pair")}
        dst = [RemoteRegion(int(addr), int(nbytes)) for addr, nbytes in reply["dst"]]
        return _Plan(int(reply["skip"]), int(reply["count"]), dst, int(offer["tag"]), peer)

    def _prepare_or_abort(
        self, sock: socket.socket, blocks: Sequence[int], plan: _Plan
    ) -> tuple[codec.KVHeader, list[torch.Tensor], torch.Tensor | None]:
        """Encode for the accepted plan; if that fails, tell decode at once instead of letting it wait."""
        try:
            return self._prepare(blocks, plan)
        except (codec.CodecError, TransportError, LayoutError) as error:
            with contextlib.suppress(TransportError):
                sidechannel.send_message(sock, {"type": "abort", "reason": str(error)})
            raise

    def _prepare(
        self, blocks: Sequence[int], plan: _Plan
    ) -> tuple[codec.KVHeader, list[torch.Tensor], torch.Tensor | None]:
        codec_used = codec.effective_codec(self.config.compression, self.kv.dtype)
        shape = self.kv.batch_shape(len(blocks))
        if codec_used is Compression.NONE and self.transport.one_sided:
            src = self.kv.regions(blocks)
            dtype = str(self.kv.dtype).removeprefix("torch.")
            return codec.KVHeader(Compression.NONE, dtype, shape, 1, regions_checksum(src)), src, None
        nbytes = codec.payload_nbytes(codec_used, self.kv.dtype, shape, self.kv.layout.groups)
        staged = self.staging.reserve(nbytes, self.config.transfer_timeout_s)
        try:
            batch = self.kv.gather(blocks)
            header, payload = codec.encode(batch, codec_used, self.kv.layout.groups, out=staged)
        except BaseException:
            self.staging.release(staged)
            raise
        return header, [payload], staged

    def _before_write(self, src: Sequence[torch.Tensor]) -> None:
        """Hook between checksum and write (tests corrupt the payload here)."""

    def close(self) -> None:
        self.wait_idle(self.config.transfer_timeout_s)
        self._unregister()

    def _unregister(self) -> None:
        self.transport.unregister(self.staging.tensor)
        for tensor in self.kv.caches:
            self.transport.unregister(tensor)


# ---- receiver -------------------------------------------------------------------------------------


@dataclass
class _Expectation:
    transfer_id: str
    block_ids: tuple[int, ...]
    skip: int
    prompt_hash: str
    deadline: float
    claimed: bool = False


class KVReceiver:
    """Decode side: serves the side channel and loads offered KV into expected blocks."""

    def __init__(self, transport: Transport, kv: PagedKV, config: PipeConfig, host: str, port: int) -> None:
        self.transport = transport
        self.kv = kv
        self.config = config
        self.stats = PipeStats()
        self.staging = StagingBuffer(config.buffer_bytes)
        transport.register(self.staging.tensor)
        kv.register_with(transport.register)
        self._cond = threading.Condition()
        self._expected: dict[str, _Expectation] = {}
        self._results: dict[str, str] = {}  # transfer id -> "" loaded, else reason
        self._server = sidechannel.Server(host, port, self._serve)

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def pending(self) -> set[str]:
        with self._cond:
            return set(self._expected)

    def expect(
        self, transfer_id: str, block_ids: Sequence[int], *, skip: int = 0, prompt_hash: str = ""
    ) -> None:
        """Decode allocated `block_ids` for this transfer's blocks from index `skip` on."""
        self.kv.check_ids(block_ids)
        deadline = time.monotonic() + self.config.prefill_wait_s
        with self._cond:
            if transfer_id in self._expected or transfer_id in self._results:
                raise TransferFailed(f"transfer {transfer_id} is already expected")
            self._expected[transfer_id] = _Expectation(
                transfer_id, tuple(block_ids), skip, prompt_hash, deadline
            )
            self._cond.notify_all()

    def cancel(self, transfer_id: str) -> None:
        """Abort: the expectation ends as failed; a later offer for it is rejected."""
        self._finish(transfer_id, "cancelled by decode")

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
        unclaimed = [e.deadline for e in self._expected.values() if not e.claimed]
        return min(unclaimed, default=time.monotonic() + 1.0)

    def _expire_unclaimed(self) -> None:
        with self._cond:
            self._expire_unclaimed_locked()

    def _expire_unclaimed_locked(self) -> None:
        now = time.monotonic()
        for expectation in list(self._expected.values()):
            if not expectation.claimed and now >= expectation.deadline:
                self._finish_locked(
                    expectation.transfer_id,
                    f"prefill sent nothing within {self.config.prefill_wait_s:.1f}s",
                    timed_out=True,
                )

    def _finish(self, transfer_id: str, reason: str, *, timed_out: bool = False) -> None:
        with self._cond:
            self._finish_locked(transfer_id, reason, timed_out=timed_out)

    def _finish_locked(self, transfer_id: str, reason: str, *, timed_out: bool = False) -> None:
        if self._expected.pop(transfer_id, None) is None:
            return
        self._results[transfer_id] = reason
        if reason:
            self.stats.failed_receives += 1
            self.stats.timeouts += timed_out
        else:
            self.stats.received += 1
        self._cond.notify_all()

    # side channel ------------------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        try:
            offer = sidechannel.expect(sock, "offer", self.config.transfer_timeout_s)
        except TransportError:
            return
        transfer_id = str(offer.get("transfer_id", ""))
        try:
            self._receive(sock, offer)
        except (TransportError, codec.CodecError, LayoutError, KeyError, ValueError) as error:
            reason = f"KV load failed: {error}"
            self.stats.checksum_failures += isinstance(error, codec.ChecksumError)
            _log.warning("KV receive %s failed: %s", transfer_id, error)
            self._finish(transfer_id, reason, timed_out=isinstance(error, TransferTimeout))
            with contextlib.suppress(TransportError):
                sidechannel.send_message(sock, {"type": "nack", "reason": reason})

    def _receive(self, sock: socket.socket, offer: Mapping[str, Any]) -> None:
        mismatches = signature_mismatches(self.kv.signature(), offer["signature"])
        if mismatches:
            raise TransferFailed("KV cache mismatch between prefill and decode: " + "; ".join(mismatches))
        expectation = self._claim(str(offer["transfer_id"]), float(offer.get("hold_s", self.config.hold_s)))
        if (
            offer.get("prompt_hash")
            and expectation.prompt_hash
            and offer["prompt_hash"] != expectation.prompt_hash
        ):
            raise TransferFailed("prompt token ids differ between prefill and decode (tokenization mismatch)")
        count = len(expectation.block_ids)
        if expectation.skip + count > int(offer["num_blocks"]):
            raise TransferFailed(
                f"decode wants {count} blocks after {expectation.skip}, prefill has {offer['num_blocks']}"
            )
        used = Compression(offer["codec"])
        staged: torch.Tensor | None = None
        try:
            if used is Compression.NONE and self.transport.one_sided:
                dst = self.kv.regions(expectation.block_ids)
            else:
                shape = self.kv.batch_shape(count)
                nbytes = codec.payload_nbytes(used, self.kv.dtype, shape, self.kv.layout.groups)
                staged = self.staging.reserve(nbytes, self.config.transfer_timeout_s)
                dst = [staged]
            regions = [[t.data_ptr(), t.numel()] for t in dst]
            endpoint = self.transport.endpoint() if self.transport.one_sided else {}
            accept = {
                "type": "accept",
                "skip": expectation.skip,
                "count": count,
                "dst": regions,
                "endpoint": endpoint,
            }
            sidechannel.send_message(sock, accept)
            peer = dict(offer["endpoint"])
            tag = int(offer["tag"])
            if not self.transport.one_sided:
                sidechannel.expect(sock, "sending", self.config.transfer_timeout_s)
                try:
                    self.transport.recv(peer, dst, tag, self.config.transfer_timeout_s)
                except TransportError:
                    self.transport.forget_peer(peer)
                    raise
            done = sidechannel.expect(sock, "done", self.config.transfer_timeout_s)
            header = codec.KVHeader.from_dict(done["header"])
            self._load(expectation, header, dst, staged)
        finally:
            if staged is not None:
                self.staging.release(staged)
        self.stats.bytes_on_wire += header.payload_nbytes
        self.stats.raw_bytes += header.raw_nbytes
        self._finish(expectation.transfer_id, "")
        sidechannel.send_message(sock, {"type": "ack"})

    def _claim(self, transfer_id: str, hold_s: float) -> _Expectation:
        """Wait (up to the sender's hold) until decode expects this id, then own it."""
        deadline = time.monotonic() + hold_s
        with self._cond:
            while True:
                self._expire_unclaimed_locked()
                expectation = self._expected.get(transfer_id)
                if expectation is not None and not expectation.claimed:
                    expectation.claimed = True
                    return expectation
                if expectation is not None or transfer_id in self._results:
                    raise TransferFailed(f"transfer {transfer_id} is not awaited any more")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"decode did not claim transfer {transfer_id} within {hold_s:.1f}s")
                self._cond.wait(min(left, 1.0))

    def _load(
        self,
        expectation: _Expectation,
        header: codec.KVHeader,
        dst: list[torch.Tensor],
        staged: torch.Tensor | None,
    ) -> None:
        expected_shape = self.kv.batch_shape(len(expectation.block_ids))
        if header.shape != expected_shape:
            raise TransferFailed(f"KV payload shape {list(header.shape)} != expected {list(expected_shape)}")
        if staged is None:
            actual = regions_checksum(dst)
            if actual != header.checksum:
                raise codec.ChecksumError(f"KV checksum {actual:#010x} != sender's {header.checksum:#010x}")
            return
        batch = codec.decode(header, staged)
        self.kv.scatter(expectation.block_ids, batch)

    def close(self) -> None:
        self._server.close()
        with self._cond:
            for transfer_id in list(self._expected):
                self._finish_locked(transfer_id, "receiver closed")
        self.transport.unregister(self.staging.tensor)
        for tensor in self.kv.caches:
            self.transport.unregister(tensor)


# ---- the seed's tensor API ------------------------------------------------------------------------


class KVPipe:
    """send_kv_cache(request_id, kv, metadata) -> bool and receive_kv_cache(request_id, timeout).

    A whole KV tensor ([blocks, ...] or any shape with a leading axis) moves as one transfer: the
    receiver pre-allocates a slot shaped like `metadata` says, keyed by request id.
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
            self.receiver.results()
            return None
        return self.buffer.clone() if outcome == "" else None

    def close(self) -> None:
        self.receiver.close()


def _single_tensor_kv(kv: torch.Tensor) -> PagedKV:
    return PagedKV({"kv": kv}, kv.shape[0], Geometry(block_size=0, num_kv_heads=0, head_dim=0))
