"""A layer's blocks as 64-bit words in three runs of axes, for a kernel that reads them where they lie.

The zero-copy checksum hashes the bytes of `view[ids]` (each block of a block-major view, in order)
without gathering them first (gpu-review item 14). A kernel that takes block ids needs each block as
a few strided runs of contiguous words: [blocks, A, B, C] with C contiguous. Every layout the
connector takes reduces to that: K and V apart ([2, N, ...]: A = 2), a head range on NHD (B = the
block's tokens, C = the range's heads), HND, MLA's latent (one run per block), the CPU's layout.
"""

from __future__ import annotations

import torch

WORD_BYTES = 8


def block_words(view: torch.Tensor) -> torch.Tensor | None:
    """`view` ([blocks, ...], any strides) as int64 words of shape [blocks, A, B, C], the last axis
    contiguous, over the same memory, so that `result[ids].reshape(-1)` holds the bytes of
    `view[ids]` in their order; None where no such view exists (a contiguous run that is not whole
    words, memory not 8-byte aligned, more than three strided axes)."""
    axes = _merged_axes(view)
    if axes is None:
        return None
    item = view.element_size()
    (a, a_stride), (b, b_stride), (c, _) = axes
    strides = (view.stride(0), a_stride, b_stride)
    if (
        (c * item) % WORD_BYTES
        or any((stride * item) % WORD_BYTES for stride in strides)
        or (view.storage_offset() * item) % WORD_BYTES
        or view.untyped_storage().data_ptr() % WORD_BYTES
    ):
        return None
    elements = torch.as_strided(
        view, (view.shape[0], a, b, c), (*strides, 1), storage_offset=view.storage_offset()
    )
    return elements.view(torch.int64)


def _merged_axes(view: torch.Tensor) -> list[tuple[int, int]] | None:
    """A block's axes as (size, stride), outermost first, with axes of size 1 dropped and neighbours
    that make one run merged; padded to three with empty outer axes. None: more than three, or the
    innermost is not contiguous."""
    merged: list[tuple[int, int]] = []
    for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if not merged:
        merged = [(1, 1)]
    if merged[-1][1] != 1 or len(merged) > 3:
        return None
    return [(1, 0)] * (3 - len(merged)) + merged
