"""The sending thread's Python work per zero-copy chunk, before and after the span table (gpu-review
item 14): from the block ids on both sides to the columns Mooncake's batch call takes, for Llama-70B at
TP 4 (80 layers, K and V apart, 16-token blocks of one rank's 2 KV heads in bf16), no bytes moved.

- `lists` (before): every span a tuple on each side, their sizes compared pairwise, merged in a Python
  loop, one Span object per merged span, the sizes checked again and the three lists built per batch.
- `table` (now): layout.span_table and merge over int64 tensors, the columns as lists (SpanList),
  the sizes compared as lists.

Both take one piece of the whole chunk, with decode's block ids shuffled (the least merging: a block's
K and V are apart, so pieces of contiguous blocks do not merge on this layout either).

    .venv/bin/python bench/zero_copy_spans.py [--tokens 32768] [--rounds 7]

Prints the median seconds per chunk each way and their ratio, measured alternately, round by round.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from dllm_connector.layout import BlockAddresses, LayerAddress
from dllm_connector.layout.span_table import merged, span_table
from dllm_connector.transport.base import Span, SpanList, check_sizes, columns

LAYERS, BLOCK_TOKENS, RANK_HEADS, HEAD_DIM, ITEM = 80, 16, 2, 128, 2
SEGMENT = BLOCK_TOKENS * RANK_HEADS * HEAD_DIM * ITEM
BATCH = 1024  # the transport's entries per batch call


def cache(seed: int, blocks: int) -> BlockAddresses:
    """One rank's cache: [2, blocks, 16, 2, 128] bf16 per layer (K and V apart, as FlashAttention's)."""
    layer_bytes = 2 * blocks * SEGMENT
    layers = tuple(
        LayerAddress((seed << 44) + layer * layer_bytes, SEGMENT, blocks * SEGMENT) for layer in range(LAYERS)
    )
    return BlockAddresses(layers, 2, ((0, SEGMENT),))


def coalesce(
    src: list[tuple[int, int]], dst: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The merge the encoder had: span pairs contiguous on both sides joined, one pair at a time."""
    merged_src: list[tuple[int, int]] = []
    merged_dst: list[tuple[int, int]] = []
    for (s_addr, length), (d_addr, _) in zip(src, dst, strict=True):
        if merged_src and sum(merged_src[-1]) == s_addr and sum(merged_dst[-1]) == d_addr:
            merged_src[-1] = (merged_src[-1][0], merged_src[-1][1] + length)
            merged_dst[-1] = (merged_dst[-1][0], merged_dst[-1][1] + length)
        else:
            merged_src.append((s_addr, length))
            merged_dst.append((d_addr, length))
    return merged_src, merged_dst


def lists(src: BlockAddresses, dst: BlockAddresses, src_ids: list[int], dst_ids: list[int]) -> int:
    ours, theirs = src.spans(src_ids), dst.spans(dst_ids)
    if len(ours) != len(theirs) or any(a != b for (_, a), (_, b) in zip(theirs, ours, strict=True)):
        raise AssertionError("sizes differ")
    merged_src, merged_dst = coalesce(ours, theirs)
    piece_src, piece_dst = [Span(*s) for s in merged_src], [Span(*d) for d in merged_dst]
    check_sizes(piece_src, piece_dst)
    for start in range(0, len(piece_src), BATCH):
        local = [span.addr for span in piece_src[start : start + BATCH]]
        remote = [span.addr for span in piece_dst[start : start + BATCH]]
        lengths = [span.nbytes for span in piece_dst[start : start + BATCH]]
        assert len(local) == len(remote) == len(lengths)
    return len(piece_src)


def table(src: BlockAddresses, dst: BlockAddresses, src_ids: list[int], dst_ids: list[int]) -> int:
    ours, theirs = span_table(src, src_ids), span_table(dst, dst_ids)
    if not ours.matches(theirs):
        raise AssertionError("sizes differ")
    runs = merged(ours.addrs.reshape(-1), theirs.addrs.reshape(-1), ours.lengths.repeat(LAYERS))
    sizes = runs[2].tolist()
    piece_src, piece_dst = SpanList(runs[0].tolist(), sizes), SpanList(runs[1].tolist(), sizes)
    check_sizes(piece_src, piece_dst)
    local, (remote, lengths) = columns(piece_src)[0], columns(piece_dst)
    for start in range(0, len(local), BATCH):
        assert len(local[start : start + BATCH]) == len(remote[start : start + BATCH])
        assert len(lengths[start : start + BATCH])
    return len(piece_src)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    blocks = args.tokens // BLOCK_TOKENS
    rng = random.Random(0)
    src_ids, dst_ids = list(range(blocks)), rng.sample(range(2 * blocks), blocks)
    src, dst = cache(1, 2 * blocks), cache(2, 2 * blocks)
    ways: dict[str, Callable[[BlockAddresses, BlockAddresses, list[int], list[int]], int]] = {
        "lists": lists,
        "table": table,
    }
    counts = {name: way(src, dst, src_ids, dst_ids) for name, way in ways.items()}  # warm, and equal
    assert counts["lists"] == counts["table"], counts
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            began = time.perf_counter()
            way(src, dst, src_ids, dst_ids)
            seconds[name].append(time.perf_counter() - began)
    lists_s, table_s = (statistics.median(seconds[name]) for name in ("lists", "table"))
    print(f"{args.tokens} tokens, {blocks} blocks, {counts['table']:,} spans per chunk after merging")
    ratio = lists_s / table_s
    print(f"lists {lists_s:.3f} s, table {table_s:.3f} s per chunk: {ratio:.1f}x less with the table")


if __name__ == "__main__":
    main()
