"""Where each KV block lives in a worker's paged caches, derived from the tensors' shapes and strides.

vLLM registers one tensor per attention layer. Its block axis is 0 (CPU: [blocks, kv_heads,
block_size, 2 * head_dim]; GPU: [blocks, 2, ...]) or 1 (GPU: [2, blocks, ...], K and V apart).
Everything inside one block at one K/V index ("a segment") must be contiguous; the layout refuses
tensors where it is not, rather than guess. The codec's scale groups split a segment into equal,
contiguous parts: one per (KV head, K or V) when the layout allows it.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class LayoutError(ValueError):
    """The caches cannot be transferred block-wise, or two workers' caches do not match."""


@dataclass(frozen=True)
class Geometry:
    """The model facts a handshake compares; the caches must agree with them."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str = "auto"
    model: str = ""


@dataclass(frozen=True)
class LayerLayout:
    block_dim: int
    segments: int
    segment_shape: tuple[int, ...]
    groups: int


def _segment_groups(segment: tuple[int, ...], geometry: Geometry) -> int:
    heads = geometry.num_kv_heads
    if len(segment) >= 2 and segment[0] == 2 and segment[1] == heads:
        return 2 * heads  # [2, heads, ...]: K and V apart, heads apart
    if segment and segment[0] == 2:
        return 2  # [2, tokens, heads, dim]: heads interleaved per token
    if segment and segment[0] == heads:
        if segment[-1] == 2 * geometry.head_dim:
            return 2 * heads  # CPU [heads, block_size, 2 * head_dim]: K rows then V rows per head
        return heads
    return 1


def layer_layout(tensor: torch.Tensor, num_blocks: int, geometry: Geometry) -> LayerLayout:
    shape = tuple(tensor.shape)
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks and num_blocks != 2:
        block_dim = 1
    elif shape and shape[0] == num_blocks:
        block_dim = 0
    else:
        raise LayoutError(f"no block axis of size {num_blocks} in a KV cache of shape {list(shape)}")
    segment = shape[block_dim + 1 :]
    expected = 1
    for dim in range(len(shape) - 1, block_dim, -1):
        if tensor.stride(dim) != expected:
            raise LayoutError(
                f"KV cache shape {list(shape)} strides {tensor.stride()}: a block is not contiguous"
            )
        expected *= shape[dim]
    return LayerLayout(block_dim, 2 if block_dim == 1 else 1, segment, _segment_groups(segment, geometry))


class PagedKV:
    """One worker's registered caches: gather, scatter and address blocks across all layers."""

    def __init__(
        self,
        caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        geometry: Geometry,
        *,
        parallel: Mapping[str, int] | None = None,
    ) -> None:
        if not caches:
            raise LayoutError("no KV caches registered")
        self.names = sorted(caches)
        self.caches = [caches[name] for name in self.names]
        self.num_blocks = num_blocks
        self.geometry = geometry
        self.parallel = dict(parallel or {})  # e.g. {"tp_size": 2}: must match the peer's
        layouts = {layer_layout(tensor, num_blocks, geometry) for tensor in self.caches}
        dtypes = {tensor.dtype for tensor in self.caches}
        if len(layouts) != 1 or len(dtypes) != 1:
            raise LayoutError("all attention layers must share one KV layout and dtype")
        self.layout = layouts.pop()
        self.dtype = dtypes.pop()
        # [blocks, segments, *segment] views; index along dim 0 selects blocks.
        self._views = [self._block_major(tensor) for tensor in self.caches]

    def _block_major(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.layout.block_dim == 1:
            return tensor.transpose(0, 1)
        return tensor.unsqueeze(1)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def segment_nbytes(self) -> int:
        count = 1
        for size in self.layout.segment_shape:
            count *= size
        return count * self.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    def signature(self) -> dict[str, Any]:
        """What the peer must match: compared field by field at the handshake."""
        return {
            "layers": len(self.caches),
            "layer_shape": [
                -1 if i == self.layout.block_dim else s for i, s in enumerate(self.caches[0].shape)
            ],
            "dtype": self.dtype_name,
            "block_size": self.geometry.block_size,
            "num_kv_heads": self.geometry.num_kv_heads,
            "head_dim": self.geometry.head_dim,
            "kv_cache_dtype": self.geometry.kv_cache_dtype,
            "model": self.geometry.model,
        } | self.parallel

    def batch_shape(self, count: int) -> tuple[int, ...]:
        """Shape of `count` blocks gathered over all layers: [layers * count * segments, *segment]."""
        return (len(self.caches) * count * self.layout.segments, *self.layout.segment_shape)

    def check_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise LayoutError(f"block ids outside 0..{self.num_blocks - 1}")
        return ids.to(self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.check_ids(block_ids)
        shape = (len(self.caches), len(block_ids), self.layout.segments, *self.layout.segment_shape)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        out = out.view(shape)
        for layer, view in enumerate(self._views):
            torch.index_select(view, 0, ids, out=out[layer])
        return out.view(self.batch_shape(len(block_ids)))

    def scatter(self, block_ids: Sequence[int], batch: torch.Tensor) -> None:
        ids = self.check_ids(block_ids)
        shape = (len(self.caches), len(block_ids), self.layout.segments, *self.layout.segment_shape)
        batch = batch.view(shape).to(self.device, non_blocking=True)  # decoded on the host for a GPU KV
        for layer, view in enumerate(self._views):
            view.index_copy_(0, ids, batch[layer])

    def spans(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(address, bytes) of every (layer, block, segment) in gather order, by stride arithmetic."""
        self.check_ids(block_ids)
        block_dim = self.layout.block_dim
        spans: list[tuple[int, int]] = []
        for tensor in self.caches:
            item = tensor.element_size()
            block_stride = tensor.stride(block_dim) * item
            segment_stride = tensor.stride(0) * item if block_dim == 1 else 0
            segment_bytes = tensor[0, 0].numel() * item if block_dim == 1 else tensor[0].numel() * item
            base = tensor.data_ptr()
            for block in block_ids:
                start = base + block * block_stride
                spans.extend((start + s * segment_stride, segment_bytes) for s in range(self.layout.segments))
        return spans

    def register_with(self, register: Any) -> None:
        for tensor in self.caches:
            register(tensor)


def spans_checksum(spans: Sequence[tuple[int, int]], value: int = 0) -> int:
    """CRC-32 over host memory spans in order (zero-copy), equal to the CRC of their concatenation."""
    for addr, nbytes in spans:
        value = zlib.crc32((ctypes.c_ubyte * nbytes).from_address(addr), value)
    return value


def coalesce(
    src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Merge neighbouring span pairs that are contiguous on both sides (fewer, larger writes)."""
    merged_src: list[tuple[int, int]] = []
    merged_dst: list[tuple[int, int]] = []
    for (s_addr, length), (d_addr, d_length) in zip(src, dst, strict=True):
        if length != d_length:
            raise LayoutError(f"span of {length} bytes paired with one of {d_length}")
        if (
            merged_src
            and merged_src[-1][0] + merged_src[-1][1] == s_addr
            and merged_dst[-1][0] + merged_dst[-1][1] == d_addr
        ):
            merged_src[-1] = (merged_src[-1][0], merged_src[-1][1] + length)
            merged_dst[-1] = (merged_dst[-1][0], merged_dst[-1][1] + length)
        else:
            merged_src.append((s_addr, length))
            merged_dst.append((d_addr, length))
    return merged_src, merged_dst


def signature_mismatches(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two caches' signatures (empty when they match)."""
    return [
        f"{key}: ours {ours.get(key)!r}, peer {theirs.get(key)!r}"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]
