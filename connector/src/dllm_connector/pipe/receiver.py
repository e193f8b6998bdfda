"""Decode's side of a transfer: serves the side channel and loads offered KV into expected blocks."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator, Sequence

import torch

from dllm_connector import codec
from dllm_connector.kv_layout import HeadRange, PagedKV, plan_tp_mapping, signature_mismatches
from dllm_connector.pipe.common import (
    EXPECTED_ERRORS,
    POLL_S,
    PipeConfig,
    PipeSide,
    RefusedWithDetail,
    TransferFailed,
    chunk_ranges,
    parse,
    parse_side,
    quoted,
    readable,
    send,
)
from dllm_connector.pipe.device_copy import HostMirror
from dllm_connector.pipe.expectations import Expectation, Expectations, Part
from dllm_connector.pipe.layer_stream import LayerStream, check_header
from dllm_connector.pipe.messages import Accept, Ack, Chunk, EndTransfer, Nack, Offer, Piece, Slot, bounded
from dllm_connector.pipe.span_checksum import chunk_checksum
from dllm_connector.pipe.staging_window import StagingWindow
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, Transport, TransportError
from dllm_connector.transport.sidechannel import Message, PeerRefused
from dllm_connector.transport.torchdist import TorchDistTransport
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)


class KVReceiver(PipeSide):
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
        self._expectations = Expectations(self.stats, config.prefill_wait_s)
        self._server = sidechannel.Server(host, port, self._serve, auth=auth)

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def waiter_wakeups(self) -> int:
        """How often a thread waiting on a transfer id woke: only the waiters of an id that changed do."""
        return self._expectations.wakeups

    @property
    def pending(self) -> set[str]:
        return self._expectations.pending

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
        self._expectations.add(transfer_id, tuple(block_ids), skip, prompt_hash, prefill_tp, senders)

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
        self._expectations.cancel(transfer_id)

    def results(self) -> dict[str, str]:
        """Expectations that ended since the last call: id -> "" when loaded, else the failure reason."""
        return self._expectations.results()

    def wait_for(self, transfer_id: str, timeout: float) -> str | None:
        """Block until this transfer ends (its outcome, consumed) or timeout (None)."""
        return self._expectations.wait_for(transfer_id, timeout)

    def wait_settled(self, transfer_id: str, timeout: float) -> bool:
        """Block until this transfer has ended, without consuming its outcome."""
        return self._expectations.wait_settled(transfer_id, timeout)

    # side channel ------------------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        """One prefill connection: an offer and its transfer, or an `end` (M2). Whatever the peer
        sends or whatever breaks, the part it claimed ends with a reason (H6)."""
        try:
            first = sidechannel.recv_message(sock, self.config.transfer_timeout_s)
            message = parse_side(first)
            if isinstance(message, EndTransfer):
                self._expectations.end_id(message.transfer_id)
                send(sock, Ack(type="ack"))
                return
            if not isinstance(message, Offer):
                raise sidechannel.unexpected(quoted(first), "offer")
            offer = message
            if isinstance(self.transport, TorchDistTransport):  # M7: only the peer's own store
                self.transport.admit(offer.endpoint, sock.getpeername()[0])
        except Exception as error:  # noqa: BLE001 - nothing was claimed: told and logged, bounded
            _send_nack(sock, f"KV load failed: {error}")
            _log.warning("KV side-channel peer refused: %s", bounded(str(error)))
            return
        part: Part | None = None
        try:
            with _nack_on_error(sock):
                part = self._check_offer(offer)
            self._receive(sock, offer, part)
        except Exception as error:  # noqa: BLE001 - every failure ends the part with its reason
            reason = bounded(f"KV load failed: {error}")
            self.stats.checksum_failures += isinstance(error, codec.ChecksumError)
            unexpected = not isinstance(error, EXPECTED_ERRORS)
            _log.warning("KV receive %s failed: %s", offer.transfer_id, reason, exc_info=unexpected)
            self._expectations.end(
                offer.transfer_id, part, reason, timed_out=isinstance(error, TransferTimeout)
            )

    def _receive(self, sock: socket.socket, offer: Offer, part: Part) -> None:
        expectation, heads = part.expectation, part.heads
        with _nack_on_error(sock):
            window, dst, sizes = self._reserve(offer, part)
        count = len(expectation.block_ids)
        chunks = chunk_ranges(count, _chunk_blocks(offer, count))
        failure: Exception | None = None
        try:
            endpoint = self.transport.endpoint() if self.transport.one_sided else {}
            slots = [] if window is None else window.slots()
            # decode's own values, not validated here: the sender validates every accept it reads
            accept = Accept.model_construct(
                type="accept", skip=expectation.skip, count=count, dst=dst, slots=slots, endpoint=endpoint
            )
            send(sock, accept)
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
                        self._settle_chunk(own)
                    if failure is not None:
                        self._tell_to_stop(sock, part, f"KV load failed: {failure}")
                    for slot, addr in [] if window is None else window.decoded(index):
                        send(sock, Slot(type="slot", index=slot, addr=addr))
                if (last := self._next_message(sock, part))["type"] != "done":
                    raise sidechannel.unexpected(quoted(last), "done")
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
        self._expectations.end(expectation.transfer_id, part, "")
        send(sock, Ack(type="ack"))

    def _settle_chunk(self, own: torch.Tensor | None) -> None:
        """After each chunk, loaded or not, before the load may be reported and before its staging
        is reused: the decode and scatter kernels this thread queued have run (one event sync on a
        device: vLLM's forward may run on another stream than this thread's; finding 11 of the
        review of issue 20). Then the staging a two-sided chunk reserved (`own`) is free."""
        try:
            self.copies.mark()()
        finally:
            if own is not None:
                self.staging.release(own)

    def _tell_to_stop(self, sock: socket.socket, part: Part, reason: str) -> None:
        """Mid-stream, once: nack now, so the sender stops writing and answers with abort (H5)."""
        if not part.told_to_stop:
            part.told_to_stop = True
            _send_nack(sock, reason)
            self.stats.stops_requested += 1

    def _reserve(
        self, offer: Offer, part: Part
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
            if not self.placement.cache_registered:
                raise TransferFailed(
                    "both engines need the same data path: prefill offered codec none block to block, "
                    f"decode's data path ({self.placement.path.value}) does not register its KV cache"
                )
            spans = [span for a, b in chunks for span in self.kv.spans(block_ids[a:b], heads)]
            return None, spans, sizes
        self.staging.check_fits(max(sizes))  # refused before the accept, whichever the transport
        if not self.transport.one_sided:  # the sender needs no addresses; batches reserve as they come
            return None, [], sizes
        return StagingWindow(self.staging, sizes, self.config.transfer_timeout_s), [], sizes

    def _check_offer(self, offer: Offer) -> Part:
        """Compare the caches, then claim the sender's part of the expectation it names."""
        mismatches = signature_mismatches(self.kv.signature(), offer.signature)
        if mismatches:
            # L2: decode's outcome and log have both sides (bounded); the peer learns only which
            # fields differ, never decode's values
            keys = sorted({line.split(":", 1)[0] for line in mismatches})
            raise RefusedWithDetail(
                "KV cache mismatch between prefill and decode: " + bounded("; ".join(mismatches)),
                "KV cache mismatch between prefill and decode in: " + bounded(", ".join(keys)),
            )
        hold = min(offer.hold_s or self.config.hold_s, self.config.hold_s)  # H4: never the peer's longer one
        return self._expectations.claim(offer.transfer_id, hold, lambda e: self._check_claim(offer, e))

    def _check_claim(self, offer: Offer, expectation: Expectation) -> Part:
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
        return Part(expectation, rank, None if heads is None else self.kv.local_heads(heads))

    def _check_tp(self, offer: Offer, expectation: Expectation) -> tuple[int, HeadRange | None]:
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
        part: Part,
        *,
        load: bool,
    ) -> None:
        """Take chunk `index` in; with load false (an earlier chunk failed) only consume it."""
        heads, expectation = part.heads, part.expectation
        draft = self._draft_header(offer, blocks, heads, staged=view is not None)
        stream = None
        mirror = None if view is None else self._mirror(view)
        if load and view is not None and self.transport.one_sided:
            stream = LayerStream(
                self.kv, draft, view, blocks, heads, lambda: expectation.failure, mirror=mirror
            )
        announced = self._chunk_message(sock, index, stream, part)
        header = codec.KVHeader.from_dict(announced.header)
        if load:
            check_header(header, draft)
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
            running = chunk_checksum(self.kv, self.checksum_algo, blocks, heads)
            running.add_layers(range(self.kv.num_layers))  # the last write landed: the chunk message
            actual = running.value
            if actual != header.checksum:
                raise codec.ChecksumError(f"KV checksum {actual:#018x} != sender's {header.checksum:#018x}")
            return
        if stream is None:  # two-sided: the whole chunk arrived at once
            if expectation.failure:  # cancelled while it was on the wire: not placed (H5)
                raise TransferFailed(f"the load failed elsewhere: {expectation.failure}")
            payload = view
            if mirror is not None:  # pinned-host: the whole batch to the device, then decoded there
                mirror.to_device([(0, view.numel())])
                payload = mirror.work
            self.kv.scatter_layers(blocks, codec.decode_parts(header, payload, self.kv.num_layers), heads)
            return
        stream.finish(header)

    def _mirror(self, view: torch.Tensor) -> HostMirror | None:
        """Pinned-host path: the scratch on the KV's device at `view`'s offset, where it is decoded from."""
        if self.scratch is None:
            return None
        return HostMirror(self.scratch.take(view), view, self.copies)

    def _draft_header(
        self, offer: Offer, blocks: Sequence[int], heads: HeadRange | None, *, staged: bool = True
    ) -> codec.KVHeader:
        """The header a chunk of `blocks` will carry, but for its checksum (known at its end).
        Zero-copy chunks (not staged) are raw blocks: codec none, one group."""
        shape, algo = self.kv.batch_shape(len(blocks), heads), self.checksum_algo
        if not staged:
            return codec.KVHeader(Compression.NONE, self.kv.dtype_name, shape, 1, 0, algo)
        return codec.KVHeader(offer.codec, self.kv.dtype_name, shape, self.kv.groups(heads), 0, algo)

    def _chunk_message(
        self, sock: socket.socket, index: int, stream: LayerStream | None, part: Part
    ) -> Chunk:
        """The announcement of chunk `index`, placing the layers its pieces bring on the way."""
        while True:
            message = self._next_message(sock, part)
            if message["type"] not in ("piece", "chunk"):
                raise sidechannel.unexpected(quoted(message), "chunk")
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

    def _next_message(self, sock: socket.socket, part: Part) -> Message:
        """The sender's next message (within the transfer timeout). A failure of the load (a cancel,
        another part) is told to the sender before each message and while waiting, so that it stops
        writing into decode's memory at once (H5)."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            if part.expectation.failure:
                self._tell_to_stop(sock, part, f"KV load failed: {part.expectation.failure}")
            if readable(sock, min(POLL_S, max(0.0, deadline - time.monotonic()))):
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

    def close(self, timeout: float | None = None) -> bool:
        """Fail every load, tell the senders of parts under way to stop, and unregister the memory
        once none writes into it (H5, M4). False (the memory stays registered) if a part is still
        active after `timeout` (default: three transfer timeouts)."""
        self._server.close()
        wait = 3 * self.config.transfer_timeout_s if timeout is None else timeout
        active = self._expectations.close("receiver closed", wait)
        if active:
            _log.error("KV loads %s still written at close: their memory stays registered", active)
            return False
        self._unregister()
        return True


def _chunk_blocks(offer: Offer, count: int) -> int:
    """Blocks per chunk of a part of `count` blocks: the offer's, which may exceed the count (one
    chunk; older senders offer their threshold), never below 1."""
    return max(1, min(offer.chunk_blocks, count))


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
        send(sock, Nack(type="nack", reason=bounded(reason)))
