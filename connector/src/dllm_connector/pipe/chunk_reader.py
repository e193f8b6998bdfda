"""Decode's read path: a part's chunks taken in one at a time, verified, and placed in their blocks."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dllm_connector import codec
from dllm_connector.layout import HeadRange
from dllm_connector.pipe.common import PipeSide, TransferFailed, parse, quoted
from dllm_connector.pipe.device_copy import HostMirror
from dllm_connector.pipe.layer_stream import LayerStream, check_header
from dllm_connector.pipe.messages import Chunk, Offer, Piece
from dllm_connector.pipe.part_channel import PartChannel
from dllm_connector.pipe.span_checksum import chunk_checksum
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransportError
from dllm_contract.kvconfig import Compression


class ChunkReader:
    """The chunks of the part `channel` serves, as `offer` announced them, on the receiving `side`."""

    def __init__(self, side: PipeSide, offer: Offer, channel: PartChannel) -> None:
        self._side = side
        self._offer = offer
        self._channel = channel

    def read(self, index: int, blocks: Sequence[int], view: torch.Tensor | None, *, load: bool) -> None:
        """Take chunk `index` in; with load false (an earlier chunk failed) only consume it."""
        side, part = self._side, self._channel.part
        heads, expectation = part.heads, part.expectation
        draft = self._draft_header(blocks, heads, staged=view is not None)
        stream = None
        mirror = None if view is None else self._mirror(view)
        if load and view is not None and side.transport.one_sided:
            stream = LayerStream(
                side.kv,
                draft,
                view,
                blocks,
                heads,
                lambda: expectation.failure,
                mirror=mirror,
                clock=side.codec_time,
            )
        announced = self._chunk_message(index, stream)
        header = codec.KVHeader.from_dict(announced.header)
        if load:
            check_header(header, draft)
        if view is not None and not side.transport.one_sided:
            peer = dict(self._offer.endpoint)
            try:
                side.transport.recv(peer, [view], self._offer.tag, side.config.transfer_timeout_s)
            except TransportError:
                side.transport.forget_peer(peer)
                raise
        if not load:
            return
        if view is None:
            running = chunk_checksum(side.kv, side.checksum_algo, blocks, heads)
            running.add_layers(range(side.kv.num_layers))  # the last write landed: the chunk message
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
            began = time.perf_counter()
            side.kv.scatter_layers(blocks, codec.decode_parts(header, payload, side.kv.num_layers), heads)
            side.codec_time.add(time.perf_counter() - began)
            return
        stream.finish(header)

    def _mirror(self, view: torch.Tensor) -> HostMirror | None:
        """Pinned-host path: the scratch on the KV's device at `view`'s offset, where it is decoded from."""
        if self._side.scratch is None:
            return None
        return HostMirror(self._side.scratch.take(view), view, self._side.copies)

    def _draft_header(
        self, blocks: Sequence[int], heads: HeadRange | None, *, staged: bool = True
    ) -> codec.KVHeader:
        """The header a chunk of `blocks` will carry, but for its checksum (known at its end).
        Zero-copy chunks (not staged) are raw blocks: codec none, one group."""
        kv = self._side.kv
        shape, algo = kv.batch_shape(len(blocks), heads), self._side.checksum_algo
        if not staged:
            return codec.KVHeader(Compression.NONE, kv.dtype_name, shape, 1, 0, algo)
        return codec.KVHeader(self._offer.codec, kv.dtype_name, shape, kv.groups(heads), 0, algo)

    def _chunk_message(self, index: int, stream: LayerStream | None) -> Chunk:
        """The announcement of chunk `index`, placing the layers its pieces bring on the way."""
        while True:
            message = self._channel.next_message()
            if message["type"] not in ("piece", "chunk"):
                raise sidechannel.unexpected(quoted(message), "chunk")
            self._side.copies.landed()  # what the message says was written is read after it
            if message["type"] == "chunk":
                chunk = parse(Chunk, message)
                if chunk.index != index:
                    raise TransferFailed(f"chunk {chunk.index} arrived where chunk {index} was due")
                return chunk
            piece = parse(Piece, message)
            if piece.index != index or piece.parts > self._side.kv.num_layers:
                raise TransferFailed(f"a piece of chunk {piece.index} arrived where chunk {index} was due")
            if stream is not None:
                stream.place_until(piece.parts)
