"""nh64 of KV blocks read where they lie: one Triton kernel that takes the block ids (gpu-review item 14).

The zero-copy checksum gathered each layer's blocks into a buffer and hashed the buffer: on each side,
two passes over the KV (the gather's read and write) before the hash's own. This kernel reads every
block once, in place, and adds its terms to a running checksum's rows: the values that
`RunningTensorChecksum.add` gives for the gathered bytes (device_checksum's definition; a test holds
the two equal on every layout and head range).

A block is [A, B, C] words (`layout.block_words`: C contiguous). Each program takes one run of C
words of one block, hashes it in tiles, and adds each tile's two sums (products, words) to the rows
its words fall in, with 64-bit integer atomics. The sums wrap, so the order the programs run in does
not change the value. The sizes and strides are arguments, not constants: a head range of another
size, or another layout, launches the same compiled kernel.

Only a GPU runs it compiled. Tests run the same kernel in Triton's interpreter on the CPU
(TRITON_INTERPRET=1, read when the kernel is first built), and check it against the gather on a GPU
where one is lent.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import triton
import triton.language as tl

ROW_BITS = 16  # device_checksum.ROW_WORDS = 1 << ROW_BITS words per row
_MAX_TILE = 1024  # words a program hashes per step (8 KiB): at most two rows per tile


def _block_terms(  # type: ignore[no-untyped-def]
    words,
    block_stride,
    a_stride,
    b_stride,
    ids,
    keys,
    rows,
    first,
    b_runs,
    runs_per_block,
    run_words,
    TILE: tl.constexpr,
    ROW: tl.constexpr,
):
    """Program p: run p % runs_per_block of the (p // runs_per_block)-th listed block."""
    program = tl.program_id(0).to(tl.int64)
    listed = program // runs_per_block
    run = program % runs_per_block
    block = tl.load(ids + listed)
    base = words + block * block_stride + (run // b_runs) * a_stride + (run % b_runs) * b_stride
    start = first + listed * runs_per_block * run_words + run * run_words  # in the checksummed stream
    for tile in range(0, run_words, TILE):
        offsets = tile + tl.arange(0, TILE)
        inside = offsets < run_words
        word = tl.load(base + offsets, mask=inside, other=0)
        position = start + offsets
        key = tl.load(keys + (position & ((1 << ROW) - 1)), mask=inside, other=0)
        mixed = word ^ key
        product = tl.where(inside, ((mixed << 32) >> 32) * (mixed >> 32), 0)  # signed halves
        row = (start + tile) >> ROW
        in_row = (position >> ROW) == row
        products_here = tl.sum(tl.where(in_row, product, 0))
        words_here = tl.sum(tl.where(in_row, word, 0))
        tl.atomic_add(rows + 2 * row, products_here)
        tl.atomic_add(rows + 2 * row + 1, words_here)
        last = start + tl.minimum(tile + TILE, run_words) - 1
        spills = (last >> ROW) > row  # the tile's end lies in the next row
        tl.atomic_add(rows + 2 * row + 2, tl.sum(product) - products_here, mask=spills)
        tl.atomic_add(rows + 2 * row + 3, tl.sum(word) - words_here, mask=spills)


_kernel: Any = None
_kernel_lock = threading.Lock()


def _built() -> Any:
    global _kernel
    with _kernel_lock:
        if _kernel is None:  # built at first use, when TRITON_INTERPRET is read
            _kernel = triton.jit(_block_terms)
        return _kernel


def add_block_terms(
    rows: torch.Tensor, words: torch.Tensor, ids: torch.Tensor, first: int, keys: torch.Tensor
) -> None:
    """rows[r] += the terms of row r of the stream made of `words[ids]` (flattened, in order) placed
    at word position `first` of the checksummed bytes. `rows`: [R, 2] int64, contiguous, R past the
    last row the words reach; `words`: [blocks, A, B, C] int64 (`layout.block_words`); `ids`: int64
    on the words' device, checked; `keys`: device_checksum's position keys there."""
    _, a, b, c = words.shape
    if not (rows.is_contiguous() and rows.dtype == torch.int64 and rows.dim() == 2 and rows.shape[1] == 2):
        raise ValueError("rows must be a contiguous [R, 2] int64 tensor")
    if words.dtype != torch.int64 or words.dim() != 4 or words.stride(3) != 1:
        raise ValueError("words must be [blocks, A, B, C] int64 with C contiguous")
    count = ids.numel()
    if count == 0 or c == 0:
        return
    last_row = (first + count * a * b * c - 1) >> ROW_BITS
    if last_row >= rows.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} rows; the words reach row {last_row}")
    tile = min(_MAX_TILE, 1 << (c - 1).bit_length())
    _built()[(count * a * b,)](
        words,
        words.stride(0),
        words.stride(1),
        words.stride(2),
        ids,
        keys,
        rows,
        first,
        b,
        a * b,
        c,
        TILE=tile,
        ROW=ROW_BITS,
    )
