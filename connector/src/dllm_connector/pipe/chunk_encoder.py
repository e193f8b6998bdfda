"""Prefill's chunks made ready to write: encoded into staging, or (codec none, zero-copy) hashed in place."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dllm_connector import codec
from dllm_connector.layout.span_table import merged, span_table
from dllm_connector.pipe.chunk_writer import (
    ChunkWriter,
    PieceStream,
    Plan,
    PreparedChunk,
    PreparedPiece,
    StagingRelease,
)
from dllm_connector.pipe.common import PipeSide, TransferFailed
from dllm_connector.pipe.device_copy import HostMirror, Ready, ready_now
from dllm_connector.pipe.host_parts import encodes_on_host
from dllm_connector.pipe.span_checksum import chunk_checksum
from dllm_connector.transport.base import Source, Span, SpanList
from dllm_contract.kvconfig import Compression


@dataclass(frozen=True)
class Encoding:
    """How a sender makes its chunks: the codec, the piece sizes, and its hook before each write."""

    codec: Compression
    piece_bytes: int
    zero_copy_piece_bytes: int
    before_write: Callable[[int, Sequence[Source]], None]


class ChunkEncoder:
    """The chunks of one accepted plan, one at a time, from the sender's side (`side`).

    `poll` hears decode between pieces (a stop ends the send); `slot(index)` waits until decode
    names where it stages chunk `index` (one-sided transports).
    """

    def __init__(
        self,
        side: PipeSide,
        encoding: Encoding,
        plan: Plan,
        writer: ChunkWriter,
        *,
        poll: Callable[[], None],
        slot: Callable[[int], int],
    ) -> None:
        self._side = side
        self._encoding = encoding
        self._plan = plan
        self._writer = writer
        self._poll = poll
        self._slot = slot

    def prepare(self, index: int, blocks: Sequence[int], first: int) -> PreparedChunk:
        """Chunk `index` encoded; on a one-sided transport its finished pieces already went to the writer."""
        side, plan, writer, encoding = self._side, self._plan, self._writer, self._encoding
        if plan.zero_copy:
            return self._prepare_in_place(index, blocks, first)
        shape = side.kv.batch_shape(len(blocks), plan.heads)
        groups = side.kv.groups(plan.heads)
        nbytes = codec.payload_nbytes(encoding.codec, side.kv.dtype, shape, groups)
        remote = self._slot(index) if side.transport.one_sided else 0
        staged = side.staging.reserve(nbytes, side.config.transfer_timeout_s)
        try:
            mirror = self._mirror(staged)  # a device allocation: it may fail (out of memory)
        except BaseException:
            side.staging.release(staged)  # nothing reads or writes it yet
            raise
        if not side.transport.one_sided:  # announced first, then sent whole: no pieces
            pieces = None
        else:
            pieces = PieceStream(
                writer,
                index,
                staged.data_ptr(),
                remote,
                self._poll,
                piece_bytes=encoding.piece_bytes,
                before_write=encoding.before_write,
            )
        ready: list[Ready] = [ready_now]

        def on_part(ranges: list[tuple[int, int]]) -> None:
            # the part's bytes go to host staging (pinned-host) or are marked once the device wrote them
            ready[0] = mirror.to_host(ranges) if mirror is not None else side.copies.mark()
            if pieces is not None:
                pieces.add(ranges, ready[0])

        began = time.perf_counter()
        try:
            out = staged if mirror is None else mirror.work
            # none: each layer is gathered straight into its place in a payload on the cache's device
            none_in_place = encoding.codec is Compression.NONE and out.device == side.kv.device
            parts = side.kv.gather_layers(blocks, plan.heads, out=out if none_in_place else None)
            if encodes_on_host(side.kv.device, out.device):
                parts = side.host_parts.copied(parts)
            header, _ = codec.encode_parts(
                parts,
                shape,
                side.kv.dtype,
                encoding.codec,
                groups,
                out=out,
                on_part=on_part,
                checksum_algo=side.checksum_algo,
            )
        except BaseException:
            with contextlib.suppress(Exception):
                ready[0]()  # no copy still writes into the staging once it is handed on
            with contextlib.suppress(Exception):
                side.copies.mark()()  # nor an encode this thread queued after the last copy
            if pieces is not None and pieces.sent:  # the writer may still be reading it
                with contextlib.suppress(Exception):
                    writer.put(StagingRelease(staged))
            else:
                side.staging.release(staged)
            raise
        side.codec_time.add(time.perf_counter() - began)  # with a one-sided transport's writes issued
        if pieces is None:  # two-sided: only the size counts
            return PreparedChunk(index, header, [staged[:nbytes]], [Span(0, nbytes)], staged, ready[0])
        src, dst = pieces.rest()
        return PreparedChunk(index, header, src, dst, staged, ready[0])

    def _mirror(self, staged: torch.Tensor) -> HostMirror | None:
        """Pinned-host path: the scratch on the KV's device at `staged`'s offset to encode in, copied
        to `staged` per part; encoded once the copies issued so far (out of any scratch) ran."""
        side = self._side
        if side.scratch is None:
            return None
        side.copies.join()
        return HostMirror(side.scratch.take(staged), staged, side.copies)

    def _prepare_in_place(self, index: int, blocks: Sequence[int], first: int) -> PreparedChunk:
        """Codec none, zero-copy: hash and write the blocks' spans a few layers at a time."""
        kv, plan, algo = self._side.kv, self._plan, self._side.checksum_algo
        src = kv.span_table(blocks, plan.heads)
        if plan.dst is None:
            raise TransferFailed(f"decode named no blocks for zero-copy chunk {index}")
        dst = span_table(plan.dst.addresses, plan.dst.blocks[first : first + len(blocks)])
        if not src.matches(dst):
            raise TransferFailed(f"decode's block spans for chunk {index} do not match this cache's")
        running = chunk_checksum(kv, algo, blocks, plan.heads)
        # The same spans in every layer: a piece is whole layers, as few as make
        # zero_copy_piece_bytes (the last piece takes what is left).
        step = max(1, -(-self._encoding.zero_copy_piece_bytes // max(1, src.layer_bytes)))
        for start in range(0, kv.num_layers, step):
            self._poll()
            stop = min(start + step, kv.num_layers)
            lengths = src.lengths.repeat(stop - start)
            runs = merged(src.addrs[start:stop].reshape(-1), dst.addrs[start:stop].reshape(-1), lengths)
            sizes = runs[2].tolist()
            piece_src, piece_dst = SpanList(runs[0].tolist(), sizes), SpanList(runs[1].tolist(), sizes)
            running.add_layers(range(start, stop), piece_src)
            piece = PreparedPiece(piece_src, piece_dst, index)
            self._encoding.before_write(index, piece.src)
            self._writer.put(piece)
        shape = kv.batch_shape(len(blocks), plan.heads)
        header = codec.KVHeader(Compression.NONE, kv.dtype_name, shape, 1, running.value, algo)
        return PreparedChunk(index, header, [], [], None)
