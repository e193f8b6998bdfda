"""nh64 of KV blocks read where they lie: one Triton kernel that takes the block ids (gpu-review item 14).

The zero-copy checksum gathered each layer's blocks into a buffer and hashed the buffer: on each side,
two passes over the KV (the gather's read and write) before the hash's own. This kernel reads every
block once, in place, and adds its terms to a running checksum's rows: the values that
`RunningTensorChecksum.add` gives for the gathered bytes (device_checksum's definition; a test holds
the two equal on every layout and head range).

A block is [A, B, C] words (`layout.block_words`: C contiguous). Each program takes one segment of
the stream (8192 words, within one row), walks the runs of C words that fall in it, a run at a time
(its block id read, its address worked out once), hashes them in tiles into per-lane sums, and adds
its two sums (products, words) to its row with one 64-bit atomic add each: eight programs a row, so
the atomics never queue on one address. The sums wrap, so the order the programs run in does not
change the value. Sizes and strides are arguments Triton does not specialize on: a head range of
another size, or another layout, launches one of the two compiled variants (a tile of 64 words for
runs under 1024, else 1024), which warm-up compiles.

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
SEGMENT_WORDS = 1 << 13  # a program's share of the stream: a row holds eight
_LONG_RUN = 1024  # runs at least this long take 1024-word tiles and four warps; shorter, 64 and one
_INTEGERS = ("block_stride", "a_stride", "b_stride", "first", "count", "b_runs", "run_words", "per_block")


def tile_words(run_words: int) -> int:
    return _LONG_RUN if run_words >= _LONG_RUN else 64


def _block_terms(  # type: ignore[no-untyped-def]
    words,
    block_stride,
    a_stride,
    b_stride,
    ids,
    keys,
    rows,
    first,
    count,
    b_runs,
    run_words,
    per_block,
    TILE: tl.constexpr,
    SEGMENT: tl.constexpr,
    ROW: tl.constexpr,
):
    """Program p: the stream's words in segment first // SEGMENT + p, those of this call."""
    low = (first // SEGMENT + tl.program_id(0).to(tl.int64)) * SEGMENT
    position = tl.maximum(low, first)
    stop = tl.minimum(low + SEGMENT, first + count)
    products = tl.zeros([TILE], dtype=tl.int64)
    sums = tl.zeros([TILE], dtype=tl.int64)
    while position < stop:
        into = position - first  # in this call's words: block, run of the block, word of the run
        listed = into // per_block
        run = (into % per_block) // run_words
        offset = (into % per_block) % run_words
        length = tl.minimum(run_words - offset, stop - position)
        block = tl.load(ids + listed)
        base = words + block * block_stride + (run // b_runs) * a_stride + (run % b_runs) * b_stride + offset
        for tile in range(0, length, TILE):
            lanes = tile + tl.arange(0, TILE)
            inside = lanes < length
            word = tl.load(base + lanes, mask=inside, other=0)
            key = tl.load(keys + ((position + lanes) & ((1 << ROW) - 1)), mask=inside, other=0)
            mixed = word ^ key
            products += tl.where(inside, ((mixed << 32) >> 32) * (mixed >> 32), 0)  # signed halves
            sums += word
        position += length
    row = low >> ROW
    tl.atomic_add(rows + 2 * row, tl.sum(products))
    tl.atomic_add(rows + 2 * row + 1, tl.sum(sums))


_kernel: Any = None
_kernel_lock = threading.Lock()


def _built() -> Any:
    global _kernel
    with _kernel_lock:
        if _kernel is None:  # built at first use, when TRITON_INTERPRET is read
            _kernel = triton.jit(
                _block_terms,
                do_not_specialize=_INTEGERS,
                do_not_specialize_on_alignment=("words",),  # a head range starts mid-block
            )
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
    count = ids.numel() * a * b * c
    if count == 0:
        return
    last_row = (first + count - 1) >> ROW_BITS
    if last_row >= rows.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} rows; the words reach row {last_row}")
    segments = (first + count - 1) // SEGMENT_WORDS - first // SEGMENT_WORDS + 1
    tile = tile_words(c)
    _built()[(segments,)](
        words,
        words.stride(0),
        words.stride(1),
        words.stride(2),
        ids,
        keys,
        rows,
        first,
        count,
        b,
        c,
        a * b * c,
        TILE=tile,
        SEGMENT=SEGMENT_WORDS,
        ROW=ROW_BITS,
        num_warps=4 if tile == _LONG_RUN else 1,
    )
