"""One part of a send, to one decode rank on its own connection: offer, accept, chunks, done, ack."""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time

from dllm_connector.layout import BlockAddresses, HeadRange, LayerAddress
from dllm_connector.pipe.chunk_encoder import ChunkEncoder, Encoding
from dllm_connector.pipe.chunk_writer import ChunkWriter, Plan, ZeroCopyTarget
from dllm_connector.pipe.common import (
    POLL_S,
    PipeSide,
    TransferFailed,
    chunk_ranges,
    parse,
    quoted,
    readable,
    send,
)
from dllm_connector.pipe.messages import Abort, Accept, Done, Offer, Slot, bounded
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_connector.transport.sidechannel import Message


class RankSend:
    """The exchange on `sock`, a side-channel connection to the decode rank that gets this part.

    Decode names where the part goes in its accept (and staging slots later, as it has room); a
    nack from it stops the send between pieces. On any failure nothing more is written, and decode
    is told abort once the write under way returned (H5). A wait for the accept ends early when
    `closing` is set.
    """

    def __init__(
        self, side: PipeSide, sock: socket.socket, encoding: Encoding, closing: threading.Event
    ) -> None:
        self._side = side
        self._sock = sock
        self._encoding = encoding
        self._closing = closing

    def run(self, offer: Offer, block_ids: tuple[int, ...], heads: HeadRange | None) -> tuple[int, int]:
        """Offer the part and send what decode accepts; its bytes on the wire and raw KV bytes."""
        side, sock = self._side, self._sock
        plan = self._offer(offer, heads)
        blocks = block_ids[plan.skip : plan.skip + plan.count]
        writer = ChunkWriter(
            side.transport, side.config.transfer_timeout_s, side.staging, sock, plan, side.kv.device
        )
        poll = functools.partial(self._poll, plan)
        encoder = ChunkEncoder(
            side, self._encoding, plan, writer, poll=poll, slot=functools.partial(self._slot, plan)
        )
        wire = raw = 0
        try:
            for index, (start, stop) in enumerate(chunk_ranges(len(blocks), plan.chunk_blocks)):
                poll()
                chunk = encoder.prepare(index, blocks[start:stop], start)
                if chunk.src:
                    self._encoding.before_write(index, chunk.src)
                writer.put(chunk)
                wire, raw = wire + chunk.header.payload_nbytes, raw + chunk.header.raw_nbytes
            writer.finish()
        except Exception as error:
            # Nothing more is written; once the writes under way returned, decode is told we
            # stopped, so it may hand the blocks on (H5).
            writer.stop(error)
            with contextlib.suppress(Exception):
                writer.finish()
            with contextlib.suppress(TransportError):
                send(sock, Abort(type="abort", reason=bounded(str(error))))
            raise
        send(sock, Done(type="done"))
        sidechannel.expect(sock, "ack", side.config.transfer_timeout_s)
        return wire, raw

    def _offer(self, offer: Offer, heads: HeadRange | None) -> Plan:
        """Send `offer`; decode's accept, checked against it, as the plan of what to write where."""
        config = self._side.config
        send(self._sock, offer)
        self._await(config.hold_s)
        reply = parse(Accept, sidechannel.expect(self._sock, "accept", config.transfer_timeout_s))
        if reply.skip + reply.count > offer.num_blocks:
            raise TransferFailed(
                f"decode accepted blocks {reply.skip}..{reply.skip + reply.count - 1}, "
                f"prefill offered {offer.num_blocks}"
            )
        chunks = len(chunk_ranges(reply.count, offer.chunk_blocks))
        if any(index >= chunks for index, _ in reply.slots):
            raise TransferFailed(f"decode named a staging slot beyond chunk {chunks - 1}")
        peer = dict(reply.endpoint) | {"pair": offer.endpoint.get("pair")}
        zero_copy = offer.zero_copy and reply.zero_copy  # staged where decode's path cannot take it in place
        return Plan(
            reply.skip,
            reply.count,
            offer.chunk_blocks,
            self._destination(reply, heads) if zero_copy else None,
            offer.tag,
            peer,
            heads,
            zero_copy,
            dict(reply.slots),
        )

    def _destination(self, reply: Accept, heads: HeadRange | None) -> ZeroCopyTarget:
        """Decode's block addresses for a zero-copy part, checked against this cache before any span is
        worked out from them: one layer each, the same segments, runs of the same lengths (so decode's
        span table is the size of this side's), one block per accepted block, addresses in int64."""
        dst, kv = reply.dst, self._side.kv
        if dst is None:
            raise TransferFailed("decode accepted a zero-copy part without naming its blocks' addresses")
        if len(dst.layers) != kv.num_layers or dst.segments != kv.layout.segments:
            raise TransferFailed(
                f"decode's cache has {len(dst.layers)} layers of {dst.segments} segments per block, "
                f"this one {kv.num_layers} of {kv.layout.segments}"
            )
        own_runs = [length for _, length in kv.addresses(heads).runs]
        if [length for _, length in dst.runs] != own_runs:
            raise TransferFailed(
                f"decode's segments hold {len(dst.runs)} runs of other lengths than this cache's "
                f"{len(own_runs)} of {own_runs[0]} bytes"
            )
        if len(dst.blocks) != reply.count:
            raise TransferFailed(f"decode named {len(dst.blocks)} blocks for the {reply.count} it accepted")
        reach = max(dst.blocks, default=0), max(offset + length for offset, length in dst.runs)
        for base, block_stride, segment_stride in dst.layers:
            if base + reach[0] * block_stride + (dst.segments - 1) * segment_stride + reach[1] >= 1 << 63:
                raise TransferFailed("decode named block addresses past the 64-bit address space")
        layers = tuple(LayerAddress(*layer) for layer in dst.layers)
        return ZeroCopyTarget(BlockAddresses(layers, dst.segments, tuple(dst.runs)), tuple(dst.blocks))

    def _await(self, timeout: float) -> None:
        """Wait until the peer's next message is there; stops early when the sender closes."""
        deadline = time.monotonic() + timeout
        while not readable(self._sock, min(POLL_S * 10, max(0.0, deadline - time.monotonic()))):
            if self._closing.is_set():
                raise TransferFailed("the KV sender is closing")
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"decode did not accept within {timeout:.1f}s")

    def _poll(self, plan: Plan) -> None:
        """Between pieces: a slot decode named is kept; a nack or abort stops the send (H5)."""
        while readable(self._sock, 0.0):
            self._take_slot(self._next_message(), plan)

    def _next_message(self) -> Message:
        """Decode's next message, within the transfer timeout."""
        return sidechannel.recv_message(self._sock, self._side.config.transfer_timeout_s)

    def _take_slot(self, message: Message, plan: Plan) -> None:
        if message["type"] != "slot":
            raise sidechannel.unexpected(quoted(message), "slot")
        slot = parse(Slot, message)
        if slot.index >= len(chunk_ranges(plan.count, plan.chunk_blocks)) or len(plan.slots) > 1024:
            raise TransferFailed(f"decode named a staging slot for chunk {slot.index}, which is not due")
        plan.slots[slot.index] = slot.addr

    def _slot(self, plan: Plan, index: int) -> int:
        """Where decode stages chunk `index`: named in the accept, or later, once decode has room."""
        while index not in plan.slots:
            self._take_slot(self._next_message(), plan)
        return plan.slots.pop(index)
