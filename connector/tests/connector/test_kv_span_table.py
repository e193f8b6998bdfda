"""A zero-copy chunk's spans as arrays (gpu-review item 14): the table lists exactly the spans the
Python lists did, on each cache layout and head range, the merge of neighbours contiguous on both
sides is the list merge's, and the transport's columns carry them with no object per span."""

from __future__ import annotations

import random

import pytest
import torch
from test_kv_block_addresses import BLOCKS, HEAD_DIM, HEADS, LAYOUTS, TOKENS

from dllm_connector.layout import BlockAddresses, Geometry, LayerAddress, PagedKV
from dllm_connector.layout.span_table import merged, span_table
from dllm_connector.transport.base import Span, SpanList, TransportError, check_sizes, columns


@pytest.mark.parametrize("heads", [None, (1, 3)], ids=["all heads", "heads 1-2"])
@pytest.mark.parametrize("caches", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_table_lists_the_caches_spans_in_gather_order(
    caches: dict[str, torch.Tensor], heads: tuple[int, int] | None
) -> None:
    kv = PagedKV(caches, BLOCKS, Geometry(block_size=TOKENS, num_kv_heads=HEADS, head_dim=HEAD_DIM))
    blocks = [7, 2, 9, 3]
    table = kv.span_table(blocks, heads)
    listed = kv.spans(blocks, heads)
    assert table.addrs.shape[0] == len(kv.caches)
    pairs = zip(table.addrs.reshape(-1).tolist(), table.lengths.repeat(len(kv.caches)).tolist(), strict=True)
    assert list(pairs) == listed
    assert table.layer_bytes == sum(n for _, n in listed) // len(kv.caches)


def test_block_ids_outside_the_cache_are_refused_before_any_address_is_made() -> None:
    kv = PagedKV(LAYOUTS["gpu [2, N, T, H, D]"], BLOCKS, Geometry(TOKENS, HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="block"):
        kv.span_table([0, BLOCKS])


def coalesce(
    src: list[tuple[int, int]], dst: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The reference: span pairs contiguous on both sides joined one pair at a time, as lists."""
    joined_src: list[tuple[int, int]] = []
    joined_dst: list[tuple[int, int]] = []
    for (s_addr, length), (d_addr, _) in zip(src, dst, strict=True):
        if joined_src and sum(joined_src[-1]) == s_addr and sum(joined_dst[-1]) == d_addr:
            joined_src[-1] = (joined_src[-1][0], joined_src[-1][1] + length)
            joined_dst[-1] = (joined_dst[-1][0], joined_dst[-1][1] + length)
        else:
            joined_src.append((s_addr, length))
            joined_dst.append((d_addr, length))
    return joined_src, joined_dst


def strided(seed: int, layers: int, segments: int, runs: tuple[tuple[int, int], ...]) -> BlockAddresses:
    """Made-up caches whose segments abut, as do neighbouring blocks ([N, 2, ...] on a GPU)."""
    extent = runs[-1][0] + runs[-1][1]
    return BlockAddresses(
        tuple(
            LayerAddress(
                base=(seed << 36) + layer * (1 << 30), block_stride=segments * extent, segment_stride=extent
            )
            for layer in range(layers)
        ),
        segments,
        runs,
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_merge_is_the_list_merge_on_blocks_that_abut_or_not(seed: int) -> None:
    """Random block ids with runs of neighbouring ids on both sides (some abut on one side only), one
    run per segment or several: the merged table is exactly coalesce() of the lists."""
    rng = random.Random(seed)
    runs = ((0, 64),) if seed % 2 else ((0, 32), (64, 32), (128, 32))
    src_addresses, dst_addresses = strided(1, 3, 1 + seed % 2, runs), strided(2, 3, 1 + seed % 2, runs)
    start = rng.randrange(100)
    src_blocks = [start + i for i in range(8)] + rng.sample(range(200, 400), 8)
    dst_blocks = [50 + i for i in range(4)] + rng.sample(range(100, 400), 12)
    src, dst = span_table(src_addresses, src_blocks), span_table(dst_addresses, dst_blocks)
    assert src.matches(dst)
    got = merged(src.addrs.reshape(-1), dst.addrs.reshape(-1), src.lengths.repeat(3))
    want_src, want_dst = coalesce(src_addresses.spans(src_blocks), dst_addresses.spans(dst_blocks))
    assert list(zip(got[0].tolist(), got[2].tolist(), strict=True)) == want_src
    assert list(zip(got[1].tolist(), got[2].tolist(), strict=True)) == want_dst
    assert len(want_src) < len(src_blocks) * 3 * src_addresses.segments * len(runs)  # something merged


def test_tables_of_other_sizes_or_lengths_do_not_match() -> None:
    runs = ((0, 64),)
    three, two = strided(1, 3, 2, runs), strided(1, 2, 2, runs)
    assert not span_table(three, [1, 2]).matches(span_table(two, [1, 2]))
    assert not span_table(three, [1, 2]).matches(span_table(three, [1, 2, 3]))
    assert not span_table(three, [1, 2]).matches(span_table(strided(1, 3, 2, ((0, 32),)), [1, 2]))


def test_a_span_list_is_spans_to_whoever_reads_it_one_by_one() -> None:
    spans = SpanList([100, 200, 300], [8, 16, 8])
    assert len(spans) == 3
    assert spans[1] == Span(200, 16)
    assert list(spans) == [Span(100, 8), Span(200, 16), Span(300, 8)]
    assert columns(spans[1:]) == ([200, 300], [16, 8])
    assert columns([Span(5, 3), torch.zeros(4, dtype=torch.int16)])[1] == [3, 8]
    with pytest.raises(ValueError, match="3 span addresses with 2 lengths"):
        SpanList([1, 2, 3], [1, 2])
    check_sizes(spans, SpanList([0, 8, 24], [8, 16, 8]))
    with pytest.raises(TransportError, match="region 2: 8 bytes to send, peer expects 9"):
        check_sizes(spans, [Span(0, 8), Span(8, 16), Span(24, 9)])


def test_layers_of_other_strides_and_no_blocks_list_as_the_lists_do() -> None:
    layers = (LayerAddress(1 << 30, 256, 4096), LayerAddress(5 << 30, 512, 128), LayerAddress(9 << 30, 64, 0))
    addresses = BlockAddresses(layers, 2, ((0, 32), (96, 32)))
    table = span_table(addresses, [4, 0, 7])
    pairs = zip(table.addrs.reshape(-1).tolist(), table.lengths.repeat(3).tolist(), strict=True)
    assert list(pairs) == addresses.spans([4, 0, 7])
    empty = span_table(addresses, [])
    assert empty.addrs.shape == (3, 0)
    assert empty.layer_bytes == 0
    assert [
        part.numel() for part in merged(empty.addrs.reshape(-1), empty.addrs.reshape(-1), empty.lengths)
    ] == [0] * 3


@pytest.mark.parametrize(
    ("src", "dst", "want"),
    [
        ([100], [500], [(100, 500, 8)]),  # one span
        ([100, 108, 116], [500, 508, 516], [(100, 500, 24)]),  # all merge
        ([100, 200, 300], [500, 508, 516], [(100, 500, 8), (200, 508, 8), (300, 516, 8)]),  # src apart
        ([100, 108, 116], [500, 600, 700], [(100, 500, 8), (108, 600, 8), (116, 700, 8)]),  # dst apart
    ],
    ids=["one", "all", "none-src", "none-dst"],
)
def test_the_merge_at_its_edges(src: list[int], dst: list[int], want: list[tuple[int, int, int]]) -> None:
    runs = merged(torch.tensor(src), torch.tensor(dst), torch.full((len(src),), 8))
    assert list(zip(*(part.tolist() for part in runs), strict=True)) == want
