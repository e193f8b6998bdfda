"""Decode's side of a transfer: serves the side channel and loads offered KV into expected blocks.

Each connection's part: its offer checked (offer_check), its chunks read (chunk_reader), its sender
told to stop when the load fails (part_channel); the loads awaited are expectations'.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Sequence

import torch

from dllm_connector import codec
from dllm_connector.layout import HeadRange, PagedKV, plan_tp_mapping
from dllm_connector.pipe.chunk_reader import ChunkReader
from dllm_connector.pipe.common import (
    EXPECTED_ERRORS,
    PipeConfig,
    PipeSide,
    TransferFailed,
    chunk_ranges,
    parse_side,
    quoted,
    send,
)
from dllm_connector.pipe.expectations import Expectations, Part
from dllm_connector.pipe.messages import (
    Accept,
    Ack,
    Destination,
    EndTransfer,
    Offer,
    RecordQuery,
    Slot,
    TransferRecord,
    bounded,
)
from dllm_connector.pipe.offer_check import check_caches, check_claim
from dllm_connector.pipe.part_channel import PartChannel, nack_on_error, send_nack
from dllm_connector.pipe.records import TransferRecords
from dllm_connector.pipe.staging_window import StagingWindow
from dllm_connector.thread_device import on_device
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, Transport, TransportError
from dllm_connector.transport.sidechannel import PeerRefused
from dllm_connector.transport.torchdist import TorchDistTransport

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
        max_connections: int = sidechannel.MIN_CONNECTIONS,
    ) -> None:
        """`max_connections`: the side channel's connections past the handshake, each an offer waiting
        for its claim or a part under way (sidechannel.connections_for sizes it)."""
        super().__init__(transport, kv, config)
        self.engine_id = engine_id
        self.records = TransferRecords()  # decode's own account of each recent transfer
        self._expectations = Expectations(self.stats, config.prefill_wait_s, self.records)
        # A peer's hello waits as long as a quiet peer may mid-transfer (kvTransfer.timeoutMs), never less
        # than the side channel's own bound: a host that stalls as a whole delays hellos as much as parts.
        handshake = max(sidechannel.HANDSHAKE_TIMEOUT_S, config.transfer_timeout_s)
        serve = on_device(kv.device, self._serve)  # each connection's device work on streams of its own
        self._server = sidechannel.Server(
            host, port, serve, auth=auth, max_connections=max_connections, handshake_timeout=handshake
        )

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def handshake_timeout_s(self) -> float:
        return self._server.handshake_timeout

    @property
    def slots(self) -> int:
        """The side channel's connections past the handshake, at most (`max_connections`)."""
        return int(self._server.max_connections)

    @property
    def side_channel(self) -> sidechannel.ServerStats:
        """The side channel's counters: connections accepted, authenticated, answered full, refused."""
        return self._server.stats

    @property
    def offers_waiting(self) -> int:
        """Offers read and waiting for decode to expect their id (each holds a connection slot)."""
        return self._expectations.claims_waiting

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

    def record(self, transfer_id: str) -> TransferRecord:
        """This rank's account of a transfer id, as the side channel answers a RecordQuery."""
        found = self.records.get(transfer_id, expected=transfer_id in self._expectations.pending)
        return TransferRecord(
            type="record",
            state=found.state,
            reason=bounded(found.reason),
            blocks=found.blocks,
            kv_bytes=found.kv_bytes,
            wire_bytes=found.wire_bytes,
            seconds=found.seconds,
            transport=bounded(self.transport.traits().kind, 64),
        )

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
            if isinstance(message, RecordQuery):
                send(sock, self.record(message.transfer_id))
                return
            if not isinstance(message, Offer):
                raise sidechannel.unexpected(quoted(first), "offer")
            offer = message
            if isinstance(self.transport, TorchDistTransport):  # M7: only the peer's own store
                self.transport.admit(offer.endpoint, sock.getpeername()[0])
        except Exception as error:  # noqa: BLE001 - nothing was claimed: told and logged, bounded
            send_nack(sock, f"KV load failed: {error}")
            _log.warning("KV side-channel peer refused: %s", bounded(str(error)))
            return
        part: Part | None = None
        try:
            with nack_on_error(sock):
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
        started = time.monotonic()
        with nack_on_error(sock):
            window, dst, sizes = self._reserve(offer, part)
        count = len(expectation.block_ids)
        chunks = chunk_ranges(count, _chunk_blocks(offer, count))
        channel = PartChannel(sock, part, self.config, self.stats)
        reader = ChunkReader(self, offer, channel)
        failure: Exception | None = None
        try:
            endpoint = self.transport.endpoint() if self.transport.one_sided else {}
            slots = [] if window is None else window.slots()
            # decode's own values, not validated here: the sender validates every accept it reads
            accept = Accept.model_construct(
                type="accept",
                skip=expectation.skip,
                count=count,
                dst=dst,
                slots=slots,
                endpoint=endpoint,
                zero_copy=dst is not None,  # block addresses named only where decode takes the write
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
                        reader.read(index, blocks, view, load=load)
                    except TransportError as error:
                        if not isinstance(error, TransferFailed):  # the channel itself broke
                            raise
                        failure = failure or error
                    except Exception as error:  # noqa: BLE001 - any failure: the sender is told to stop
                        failure = failure or error  # and the rest is consumed, so nothing writes after
                    finally:
                        self._settle_chunk(own)
                    if failure is not None:
                        channel.tell_to_stop(f"KV load failed: {failure}")
                    for slot, addr in [] if window is None else window.decoded(index):
                        send(sock, Slot(type="slot", index=slot, addr=addr))
                if (last := channel.next_message())["type"] != "done":
                    raise sidechannel.unexpected(quoted(last), "done")
                if failure is None and expectation.failure:
                    failure = TransferFailed(f"the load failed elsewhere: {expectation.failure}")
            except TransportError as error:
                channel.refuse_and_drain(
                    f"KV load failed: {error}",
                    drain=not isinstance(error, PeerRefused),
                    slow=isinstance(error, TransferTimeout),
                )
                if failure is not None:  # the sender stopped because decode told it why
                    raise failure from None
                raise
            if failure is not None:
                channel.refuse_and_drain(f"KV load failed: {failure}", drain=False)
                raise failure
        except BaseException:
            self._fence_drained()
            raise
        finally:
            if window is not None:
                window.release()
        wire_bytes, kv_bytes = sum(sizes), self.kv.batch_nbytes(count, heads)
        self.stats.bytes_on_wire += wire_bytes
        self.stats.raw_bytes += kv_bytes
        seconds = time.monotonic() - started
        self.durations.add(seconds)
        self.records.add_part(
            expectation.transfer_id, blocks=count, kv_bytes=kv_bytes, wire_bytes=wire_bytes, seconds=seconds
        )
        self._expectations.end(expectation.transfer_id, part, "")
        send(sock, Ack(type="ack"))

    def _fence_drained(self) -> None:
        """After a failed part, whose last pieces were drained unread: what they said landed (Mooncake's
        TCP build copies on the legacy default stream) and this thread's kernels are done before its
        blocks or staging are handed on."""
        with contextlib.suppress(Exception):
            self.copies.landed()
        with contextlib.suppress(Exception):
            self.copies.mark()()

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

    def _reserve(
        self, offer: Offer, part: Part
    ) -> tuple[StagingWindow | None, Destination | None, list[int]]:
        """Name where each chunk of this part goes: decode's blocks (zero-copy: their addresses as
        arithmetic), or staging (one-sided: a window of it, the first slots named in the accept), or
        nothing (two-sided)."""
        block_ids, heads = part.expectation.block_ids, part.heads
        chunks = chunk_ranges(len(block_ids), _chunk_blocks(offer, len(block_ids)))
        groups = self.kv.groups(heads)
        sizes = [
            codec.payload_nbytes(offer.codec, self.kv.dtype, self.kv.batch_shape(b - a, heads), groups)
            for a, b in chunks
        ]
        if self._takes_zero_copy(offer):
            self.kv.check_ids(block_ids)
            where = self.kv.addresses(heads)
            # decode's own values, not validated here: the sender validates every accept it reads
            dst = Destination.model_construct(
                layers=[(a.base, a.block_stride, a.segment_stride) for a in where.layers],
                segments=where.segments,
                runs=list(where.runs),
                blocks=list(block_ids),
            )
            return None, dst, sizes
        self.staging.check_fits(max(sizes))  # refused before the accept, whichever the transport
        if not self.transport.one_sided:  # the sender needs no addresses; batches reserve as they come
            return None, None, sizes
        return StagingWindow(self.staging, sizes, self.config.transfer_timeout_s), None, sizes

    def _takes_zero_copy(self, offer: Offer) -> bool:
        """Block-to-block writes where prefill offers them and this data path registered the cache.
        Where it did not (engines on different data paths, say GPUDirect on prefill's nodes only),
        the part is staged instead, as a codec that needs staging would be (gpu-review item 8)."""
        return offer.zero_copy and self.transport.one_sided and self.placement.cache_registered

    def _check_offer(self, offer: Offer) -> Part:
        """Compare the caches, then claim the sender's part of the expectation it names."""
        check_caches(self.kv, offer)
        hold = min(offer.hold_s or self.config.hold_s, self.config.hold_s)  # H4: never the peer's longer one
        return self._expectations.claim(
            offer.transfer_id, hold, lambda e: check_claim(self.kv, self.engine_id, offer, e)
        )

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
