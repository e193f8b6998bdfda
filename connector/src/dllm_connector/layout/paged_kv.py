"""Where each KV block lives in a worker's paged caches, from the tensors' shapes and strides."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

from dllm_connector.layout.block_addresses import BlockAddresses, LayerAddress
from dllm_connector.layout.block_words import block_words
from dllm_connector.layout.layer_layout import layer_layout, segment_groups
from dllm_connector.layout.span_table import SpanTable, span_table
from dllm_connector.layout.tp_mapping import (
    Geometry,
    HeadRange,
    LayoutError,
    TPMappingError,
    TPRank,
    head_split_problem,
    rank_heads,
)


def memory_axis_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's axes from outermost to innermost in memory; ties (axes of size 1) keep their order."""
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda axis: -strides[axis]))


def in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a view whose axes follow its memory, outermost first: vLLM hands a head-major cache
    (VLLM_KV_CACHE_LAYOUT=HND, FlashInfer on Blackwell) as a permuted view of logical shape
    [2, N, T, H, D] over [2, N, H, T, D] in memory (gpu-review item 7). Unpermuted tensors come back as
    they are; ties (axes of size 1) keep their order."""
    order = memory_axis_order(tensor)
    return tensor if order == tuple(range(tensor.dim())) else tensor.permute(order)


class PagedKV:
    """One worker's registered caches: gather, scatter and address blocks across all layers.

    `heads`, where given, is a [start, stop) range of this rank's KV heads (a head sub-range, for a
    peer with another TP size); None means every head of the block.
    """

    def __init__(
        self,
        caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        geometry: Geometry,
        *,
        tp: TPRank | None = None,
    ) -> None:
        if not caches:
            raise LayoutError("no KV caches registered")
        self.names = sorted(caches)
        orders = {memory_axis_order(caches[name]) for name in self.names}
        if len(orders) != 1:
            raise LayoutError("all attention layers must share one KV layout and dtype")
        # How the handed-over view maps onto memory: told to the peer when it is not the identity, so a
        # head-major engine never pairs with a token-major one even where their shapes read the same.
        self.axis_order = orders.pop()
        self.caches = [in_memory_order(caches[name]) for name in self.names]
        self.num_blocks = num_blocks
        self.geometry = geometry
        self.tp = tp or TPRank()
        layouts = {layer_layout(tensor, num_blocks, geometry) for tensor in self.caches}
        dtypes = {tensor.dtype for tensor in self.caches}
        if len(layouts) != 1 or len(dtypes) != 1:
            raise LayoutError("all attention layers must share one KV layout and dtype")
        self.layout = layouts.pop()
        self.dtype = dtypes.pop()
        self._check_rank_heads()
        # [blocks, segments, *segment] views; index along dim 0 selects blocks. Gathers and scatters go
        # through the second set, whose segments may swap tokens and heads (layer_layout).
        self._views = [self._block_major(tensor) for tensor in self.caches]
        self._gathered_views = [self._gathered_order(view) for view in self._views]
        self._block_words: dict[HeadRange | None, list[torch.Tensor] | None] = {}  # by head range

    def _check_rank_heads(self) -> None:
        total = self.geometry.total_kv_heads
        if total <= 0:
            return
        problem = head_split_problem(total, self.tp.size)
        if problem is not None:
            raise TPMappingError(f"TP rank {self.tp.rank}: {problem}")
        start, stop = self.own_heads
        if stop - start != self.geometry.num_kv_heads:
            raise LayoutError(
                f"TP rank {self.tp.rank} of {self.tp.size} should hold {stop - start} of {total} KV heads, "
                f"its cache has {self.geometry.num_kv_heads}"
            )

    def _block_major(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.layout.block_dim == 1:
            return tensor.transpose(0, 1)
        return tensor.unsqueeze(1)

    def _gathered_order(self, view: torch.Tensor) -> torch.Tensor:
        if not self.layout.heads_outermost:
            return view
        return view.transpose(-3, -2)

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def segment_nbytes(self) -> int:
        return _product(self.layout.segment_shape) * self.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def own_heads(self) -> HeadRange:
        """The model KV heads this rank holds."""
        return rank_heads(self.geometry.model_kv_heads, self.tp.size, self.tp.rank)

    def local_heads(self, model_heads: HeadRange) -> HeadRange:
        """A range of model KV heads as a range of this rank's heads; it must lie within them."""
        first, last = self.own_heads
        start, stop = model_heads
        if not first <= start < stop <= last:
            raise LayoutError(
                f"KV heads {start}..{stop - 1} are not all on this rank (it holds {first}..{last - 1})"
            )
        return start - first, stop - first

    def part_heads(self, model_heads: HeadRange | None) -> HeadRange | None:
        """The heads a part between two ranks moves, as a range of this rank's heads. None (the whole
        block) where the cache shows no head axis and the range is all of its heads: MLA's one latent,
        the same on every rank, reaching a rank of another TP size. Where a head axis exists both ends
        keep ranges, whose runs of memory must match run for run."""
        if model_heads is None:
            return None
        local = self.local_heads(model_heads)
        whole = local == (0, self.geometry.num_kv_heads)
        return None if whole and self.layout.head_axis is None else local

    def signature(self) -> dict[str, Any]:
        """What the peer must match (the block axis and this rank's head count aside), field by field."""
        layer_shape = list(self.caches[0].shape)
        layer_shape[self.layout.block_dim] = -1
        if self.layout.head_axis is not None:
            layer_shape[self.layout.block_dim + 1 + self.layout.head_axis] = -1
        return (
            {
                "layers": len(self.caches),
                "layer_shape": layer_shape,
                "dtype": self.dtype_name,
                "block_size": self.geometry.block_size,
                "num_kv_heads": self.geometry.model_kv_heads,
                "head_dim": self.geometry.head_dim,
                "kv_cache_dtype": self.geometry.kv_cache_dtype,
                "model": self.geometry.model,
            }
            | (
                {}
                if self.axis_order == tuple(range(len(self.axis_order)))
                else {"axis_order": list(self.axis_order)}
            )
            | ({"gathered": "heads outermost"} if self.layout.heads_outermost else {})
        )

    def segment_shape(self, heads: HeadRange | None = None) -> tuple[int, ...]:
        """One gathered segment's shape (what a batch holds per segment), or that of its part holding
        `heads`."""
        return self._narrowed(self.layout.gathered_segment_shape, heads, gathered=True)

    def _memory_segment_shape(self, heads: HeadRange | None) -> tuple[int, ...]:
        return self._narrowed(self.layout.segment_shape, heads, gathered=False)

    def _narrowed(
        self, segment: tuple[int, ...], heads: HeadRange | None, *, gathered: bool
    ) -> tuple[int, ...]:
        if heads is None:
            return segment
        axis, (start, stop) = self._required_head_axis(gathered=gathered), heads
        if not 0 <= start < stop <= segment[axis]:
            raise LayoutError(f"KV head range {start}..{stop - 1} outside this rank's {segment[axis]} heads")
        return (*segment[:axis], stop - start, *segment[axis + 1 :])

    def _required_head_axis(self, *, gathered: bool = False) -> int:
        axis = self.layout.gathered_head_axis if gathered else self.layout.head_axis
        if axis is None:
            raise LayoutError(
                f"cannot address KV head sub-ranges in a cache of shape {list(self.caches[0].shape)} "
                f"({self.geometry.num_kv_heads} heads, block size {self.geometry.block_size})"
            )
        return axis

    def groups(self, heads: HeadRange | None = None) -> int:
        """The codec's scale groups per gathered segment (of `heads`)."""
        if heads is None:
            return self.layout.groups
        segment = self.segment_shape(heads)  # raises where no head sub-range can be addressed
        return segment_groups(segment, True, heads[1] - heads[0], self.geometry.head_dim)

    def batch_shape(self, count: int, heads: HeadRange | None = None) -> tuple[int, ...]:
        """Shape of `count` blocks gathered over all layers: [layers * count * segments, *segment]."""
        return (len(self.caches) * count * self.layout.segments, *self.segment_shape(heads))

    def batch_nbytes(self, count: int, heads: HeadRange | None = None) -> int:
        return _product(self.batch_shape(count, heads)) * self.dtype.itemsize

    def check_ids(self, block_ids: Sequence[int]) -> None:
        """On the host only: a check that made a device tensor synchronised the engine's stream with
        the host on every load vLLM started (gpu-review item 10)."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise LayoutError(f"block ids outside 0..{self.num_blocks - 1}")

    def device_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The checked ids on the cache's device, for a gather or scatter: copied from page-locked
        memory without waiting for the stream (a pageable copy waits for all the stream's work,
        gpu-review item 11)."""
        self.check_ids(block_ids)
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if self.device.type == "cpu":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    def _head_views(self, heads: HeadRange | None, *, gathered: bool = True) -> list[torch.Tensor]:
        """Block-major views of every layer (of `heads`): in gathered order, or memory order."""
        views = self._gathered_views if gathered else self._views
        if heads is None:
            return views
        dim, (start, stop) = 2 + self._required_head_axis(gathered=gathered), heads
        return [view.narrow(dim, start, stop - start) for view in views]

    def gather(
        self, block_ids: Sequence[int], out: torch.Tensor | None = None, heads: HeadRange | None = None
    ) -> torch.Tensor:
        ids = self.device_ids(block_ids)
        shape = self._layered_shape(len(block_ids), heads)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        out = out.view(shape)
        for layer, view in enumerate(self._head_views(heads)):
            torch.index_select(view, 0, ids, out=out[layer])
        return out.view(self.batch_shape(len(block_ids), heads))

    def gather_layers(
        self, block_ids: Sequence[int], heads: HeadRange | None = None, out: torch.Tensor | None = None
    ) -> Iterator[torch.Tensor]:
        """The batch `gather` returns, one layer at a time in one reused buffer (each part is valid
        until the next is taken): a consumer that encodes each part finds it still in cache.

        With `out` (bytes, e.g. a payload) each layer is gathered into its place there instead.
        """
        ids = self.device_ids(block_ids)
        layered = self._layered_shape(len(block_ids), heads)
        if out is None:
            reused = torch.empty(layered[1:], dtype=self.dtype, device=self.device)
            places: Iterable[torch.Tensor] = itertools.repeat(reused)
        else:
            places = out[: _product(layered) * self.dtype.itemsize].view(self.dtype).view(layered)
        rows = (len(block_ids) * self.layout.segments, *self.segment_shape(heads))
        for view, part in zip(self._head_views(heads), places, strict=False):
            torch.index_select(view, 0, ids, out=part)
            yield part.view(rows)

    def gathered_bytes(
        self, block_ids: Sequence[int], heads: HeadRange | None, layers: range, max_bytes: int
    ) -> Iterator[torch.Tensor]:
        """The bytes `spans` lists for `layers`, in the same order, as flat uint8 runs on the cache's
        device: each layer's blocks gathered (index_select) into one reused buffer of at most
        `max_bytes` (but one block), so a device hashes them in a few launches per layer, not one
        run per span. Each run is valid until the next is taken (on a device: until the next
        gather, queued after what reads it on the same stream)."""
        ids = self.device_ids(block_ids)
        block = (self.layout.segments, *self._memory_segment_shape(heads))
        per_block = _product(block) * self.dtype.itemsize
        step = max(1, min(len(block_ids), max_bytes // per_block))
        buffer = torch.empty(step * _product(block), dtype=self.dtype, device=self.device)
        for view in self._head_views(heads, gathered=False)[layers.start : layers.stop]:
            for start in range(0, len(block_ids), step):
                selected = ids[start : start + step]
                out = buffer[: selected.numel() * _product(block)].view(selected.numel(), *block)
                torch.index_select(view, 0, selected, out=out)
                yield out.view(-1).view(torch.uint8)

    def block_words(self, heads: HeadRange | None) -> list[torch.Tensor] | None:
        """Every layer's blocks (of `heads`) as int64 words [blocks, A, B, C] over the cache's memory,
        in the order `gathered_bytes` gives their bytes (layout.block_words); None where a layer's
        blocks are not whole words. Made once per head range: every chunk's checksum asks again."""
        if heads not in self._block_words:
            words = [block_words(view) for view in self._head_views(heads, gathered=False)]
            whole = None if any(layer is None for layer in words) else cast(list[torch.Tensor], words)
            self._block_words[heads] = whole
        return self._block_words[heads]

    def scatter(self, block_ids: Sequence[int], batch: torch.Tensor, heads: HeadRange | None = None) -> None:
        layers = batch.view(self._layered_shape(len(block_ids), heads))
        self.scatter_layers(block_ids, layers.unbind(0), heads)

    def scatter_layers(
        self,
        block_ids: Sequence[int],
        parts: Iterable[torch.Tensor],
        heads: HeadRange | None = None,
        layers: range | None = None,
    ) -> None:
        """Place a batch handed over one layer at a time, in layer order (as `gather_layers` gives it);
        with `layers`, only those layers' parts (a batch that arrives a few layers at a time)."""
        ids = self.device_ids(block_ids)
        shape = self._layered_shape(len(block_ids), heads)[1:]
        views = self._head_views(heads)
        wanted = views if layers is None else views[layers.start : layers.stop]
        placed = 0
        for view, part in zip(wanted, parts, strict=False):
            _copy_blocks(view, ids, part.view(shape).to(self.device, non_blocking=True))
            placed += 1
        if placed == len(wanted):
            return
        if layers is None:
            raise LayoutError(f"KV batch held {placed} layers, this engine has {len(views)}")
        raise LayoutError(f"KV batch held {placed} of layers {layers.start}..{layers.stop - 1}")

    def _layered_shape(self, count: int, heads: HeadRange | None) -> tuple[int, ...]:
        return (len(self.caches), count, self.layout.segments, *self.segment_shape(heads))

    def spans(
        self, block_ids: Sequence[int], heads: HeadRange | None = None, layers: range | None = None
    ) -> list[tuple[int, int]]:
        """(address, bytes) of every (layer, block, segment) in gather order, by stride arithmetic
        (of `layers` only, where given).

        With `heads`, each segment contributes the runs that hold those heads: one run on the CPU
        and HND layouts, one per token on NHD (both sides then list runs of the same sizes).
        """
        self.check_ids(block_ids)
        return self.addresses(heads).spans(block_ids, layers)

    def span_table(self, block_ids: Sequence[int], heads: HeadRange | None = None) -> SpanTable:
        """The spans `spans` lists, as a table (a zero-copy chunk's writes, gpu-review item 14)."""
        self.check_ids(block_ids)
        return span_table(self.addresses(heads), block_ids)

    def addresses(self, heads: HeadRange | None = None) -> BlockAddresses:
        """The arithmetic `spans` does, for a peer to do it (decode's accept, gpu-review item 5)."""
        block_dim = self.layout.block_dim
        layers = []
        for tensor in self.caches:
            item = tensor.element_size()
            layers.append(
                LayerAddress(
                    base=tensor.data_ptr(),
                    block_stride=tensor.stride(block_dim) * item,
                    segment_stride=tensor.stride(0) * item if block_dim == 1 else 0,
                )
            )
        return BlockAddresses(tuple(layers), self.layout.segments, tuple(self._head_runs(heads)))

    def run_nbytes(self, heads: HeadRange | None = None) -> int:
        """The length of each run of memory `spans` lists for `heads`."""
        return self._head_runs(heads)[0][1]

    def _head_runs(self, heads: HeadRange | None) -> list[tuple[int, int]]:
        """(offset, bytes) inside one segment of the memory holding `heads` (all of it for None)."""
        item, segment = self.dtype.itemsize, self.layout.segment_shape
        if heads is None:
            return [(0, _product(segment) * item)]
        axis, (start, stop) = self._required_head_axis(), heads
        self._memory_segment_shape(heads)  # checks the range
        head_bytes = _product(segment[axis + 1 :]) * item
        row_bytes = segment[axis] * head_bytes
        return [
            (row * row_bytes + start * head_bytes, (stop - start) * head_bytes)
            for row in range(_product(segment[:axis]))
        ]

    def register_with(self, register: Any) -> None:
        for tensor in self.caches:
            register(tensor)


def _product(sizes: Sequence[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _copy_blocks(target: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """target[ids] = blocks, along the first axis. On the host, moved as 16-byte elements where the
    memory allows (rows of whole 16-byte units, 16-byte aligned): index_copy_ there copies element
    by element, and 16-byte elements move an order of magnitude faster than bf16 ones, as fast as
    index_select's gather (docs/kv-connector.md, Codec: Placing blocks)."""
    if (
        target.device.type == "cpu"
        and blocks.device.type == "cpu"
        and (target.data_ptr() | blocks.data_ptr()) % 16 == 0
    ):
        try:
            target.view(torch.complex128).index_copy_(0, ids, blocks.view(torch.complex128))
            return
        except RuntimeError:  # a row's bytes or strides not in 16-byte units
            pass
    target.index_copy_(0, ids, blocks)
