"""Different TP sizes on prefill and decode: which rank sends which KV heads, and head addressing.

The mapping is pure (layout.plan_tp_mapping); the head sub-ranges of the paged caches are
checked against plain tensor slicing of the full model's KV, on the CPU and GPU NHD layouts.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import pytest
import torch
from kv_peer import LAYOUTS, TP_BLOCKS, TP_GEOMETRY, full_model_kv, heads_of, rank_kv

from dllm_connector.codec.checksum import spans_checksum
from dllm_connector.layout import (
    Geometry,
    LayoutError,
    PagedKV,
    TPMappingError,
    TPRank,
    coalesce_runs,
    layer_layout,
    plan_tp_mapping,
    rank_heads,
    signature_mismatches,
)

pytestmark = pytest.mark.timeout(30)


def test_rank_heads_split_or_replicate_as_vllm_does() -> None:
    assert [rank_heads(8, 2, rank) for rank in range(2)] == [(0, 4), (4, 8)]
    assert [rank_heads(8, 4, rank) for rank in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [rank_heads(8, 16, rank)[0] for rank in range(16)] == [r // 2 for r in range(16)]
    assert [rank_heads(2, 8, rank) for rank in range(8)] == [(r // 4, r // 4 + 1) for r in range(8)]
    assert rank_heads(8, 1, 0) == (0, 8)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "pairs"),
    [
        (1, 1, {(0, 0): (0, 8)}),
        (1, 2, {(0, 0): (0, 4), (0, 1): (4, 8)}),
        (2, 1, {(0, 0): (0, 4), (1, 0): (4, 8)}),
        (2, 4, {(0, 0): (0, 2), (0, 1): (2, 4), (1, 2): (4, 6), (1, 3): (6, 8)}),
        (4, 2, {(0, 0): (0, 2), (1, 0): (2, 4), (2, 1): (4, 6), (3, 1): (6, 8)}),
        (4, 8, {(rank // 2, rank): (rank, rank + 1) for rank in range(8)}),
        # decode replicates: two decode ranks share each head, one prefill rank sends it to both
        (8, 16, {(rank // 2, rank): (rank // 2, rank // 2 + 1) for rank in range(16)}),
    ],
)
def test_mapping_for_eight_kv_heads(
    prefill_tp: int, decode_tp: int, pairs: dict[tuple[int, int], tuple[int, int]]
) -> None:
    mapping = plan_tp_mapping(8, prefill_tp, decode_tp)
    assert dict(mapping.pairs) == pairs
    assert_every_decode_head_sent_once(mapping.pairs, 8, prefill_tp, decode_tp)


def test_replicated_prefill_heads_are_sent_once_per_decode_rank_and_shared() -> None:
    # 8 heads over prefill TP 16: every head on two prefill ranks; decode TP 2 needs 4 heads each
    mapping = plan_tp_mapping(8, 16, 2)
    assert_every_decode_head_sent_once(mapping.pairs, 8, 16, 2)
    assert mapping.senders_to(0) == {0: (0, 1), 2: (1, 2), 4: (2, 3), 6: (3, 4)}
    assert mapping.senders_to(1) == {9: (4, 5), 11: (5, 6), 13: (6, 7), 15: (7, 8)}
    # both sides replicate: 2 heads over prefill TP 4 and decode TP 8
    replicated = plan_tp_mapping(2, 4, 8)
    assert_every_decode_head_sent_once(replicated.pairs, 2, 4, 8)
    senders = Counter(src for src, _ in replicated.pairs)
    assert senders == {0: 2, 1: 2, 2: 2, 3: 2}  # the holders of a head share its decode ranks
    assert replicated.sends_from(0) == {0: (0, 1), 2: (0, 1)}


def assert_every_decode_head_sent_once(pairs: object, heads: int, prefill_tp: int, decode_tp: int) -> None:
    assert isinstance(pairs, dict)
    for decode_rank in range(decode_tp):
        got = sorted(
            head
            for (src, dst), (start, stop) in pairs.items()
            if dst == decode_rank
            for head in range(start, stop)
        )
        assert got == list(range(*rank_heads(heads, decode_tp, decode_rank)))  # every head, once
    for (src, _), (start, stop) in pairs.items():
        first, last = rank_heads(heads, prefill_tp, src)
        assert first <= start < stop <= last  # a sender holds what it sends


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp", "message"),
    [
        (6, 4, 2, "cannot map 6 KV heads from prefill TP 4 to decode TP 2: 6 KV heads do not split evenly"),
        (8, 2, 3, "cannot map 8 KV heads from prefill TP 2 to decode TP 3: 8 KV heads do not split evenly"),
        (
            4,
            6,
            1,
            "cannot map 4 KV heads from prefill TP 6 to decode TP 1: TP 6 is not a multiple of 4 KV heads",
        ),
        (0, 1, 2, "cannot map 0 KV heads from prefill TP 1 to decode TP 2"),
    ],
)
def test_unmappable_combinations_name_both_tp_sizes_and_the_heads(
    heads: int, prefill_tp: int, decode_tp: int, message: str
) -> None:
    with pytest.raises(TPMappingError, match=message):
        plan_tp_mapping(heads, prefill_tp, decode_tp)


def test_a_cache_that_does_not_hold_its_ranks_heads_is_refused() -> None:
    caches = {"a": torch.zeros(TP_BLOCKS, 8, 16, 64)}
    with pytest.raises(LayoutError, match="TP rank 1 of 2 should hold 4 of 8 KV heads, its cache has 8"):
        PagedKV(caches, TP_BLOCKS, TP_GEOMETRY, tp=TPRank(1, 2))
    with pytest.raises(TPMappingError, match="TP rank 0: 8 KV heads do not split evenly over TP 3"):
        PagedKV(caches, TP_BLOCKS, TP_GEOMETRY, tp=TPRank(0, 3))


# ---- head sub-ranges of the paged caches ----------------------------------------------------------


def _memory(spans: list[tuple[int, int]]) -> bytes:
    return b"".join(bytes((ctypes.c_ubyte * length).from_address(addr)) for addr, length in spans)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_ranges_gather_scatter_and_spans_agree_with_the_full_model(layout: str) -> None:
    kv = rank_kv(7, layout, TPRank(1, 2))  # model heads 4..7
    full = full_model_kv(7, layout)
    blocks = [40, 3, 77, 12]
    block_axis = 0 if layout == "cpu" else 1
    for local, model in [((1, 3), (5, 7)), ((0, 4), (4, 8)), ((3, 4), (7, 8))]:
        batch = kv.gather(blocks, heads=local)
        want = [
            heads_of(layer, layout, model).index_select(block_axis, torch.tensor(blocks)) for layer in full
        ]
        memory_order = batch
        if layout == "nhd":  # [2, n, T, h, D] -> the gather order [n, 2, h, T, D], heads outermost
            want = [layer.transpose(0, 1).transpose(2, 3) for layer in want]
            memory_order = batch.transpose(-3, -2).contiguous()
        assert torch.equal(batch.reshape(-1), torch.cat([layer.reshape(-1) for layer in want]))
        spans = kv.spans(blocks, heads=local)
        assert _memory(spans) == memory_order.contiguous().view(torch.uint8).numpy().tobytes()
        assert spans_checksum(spans) == spans_checksum([(memory_order.data_ptr(), memory_order.numel() * 2)])
        assert kv.batch_nbytes(len(blocks), local) == batch.numel() * batch.element_size()


def test_nhd_head_ranges_are_strided_per_token_and_whole_heads_coalesce() -> None:
    kv = rank_kv(7, "nhd", TPRank(0, 1))  # all 8 heads, [2, blocks, 16 tokens, 8 heads, 32]
    part = kv.spans([5], heads=(2, 4))
    assert len(part) == 3 * 2 * 16  # layers x K/V x tokens
    assert {length for _, length in part} == {2 * 32 * 2}
    assert part[1][0] - part[0][0] == 8 * 32 * 2  # one token further
    whole = kv.spans([5], heads=(0, 8))
    per_segment = kv.spans([5])
    assert len(per_segment) == 3 * 2
    assert coalesce_runs(whole) == coalesce_runs(per_segment)  # all heads: one run per segment
    cpu = rank_kv(7, "cpu", TPRank(0, 1))
    assert len(cpu.spans([5], heads=(2, 4))) == 3  # CPU: a head range is one run per block
    assert cpu.spans([5], heads=(0, 8)) == cpu.spans([5])


def test_scatter_into_a_head_range_leaves_the_other_heads_alone() -> None:
    for layout in LAYOUTS:
        source = rank_kv(7, layout, TPRank(0, 2))
        target = rank_kv(None, layout, TPRank(0, 1))  # 8 heads
        target.scatter([9, 2], source.gather([1, 4]), heads=(0, 4))
        assert torch.equal(target.gather([9, 2], heads=(0, 4)), source.gather([1, 4]))
        assert not bool(target.gather([9, 2], heads=(4, 8)).any())
        assert not bool(target.gather([1, 4]).any())


@pytest.mark.parametrize(
    ("shape", "heads", "groups"),
    [
        ((TP_BLOCKS, 4, 16, 64), (1, 3), 4),  # CPU: per head, K half and V half
        ((2, TP_BLOCKS, 16, 4, 32), (1, 3), 2),  # NHD, K and V apart: gathered per head
        ((2, TP_BLOCKS, 4, 16, 32), (0, 1), 1),  # HND, K and V apart: per head
        ((TP_BLOCKS, 2, 16, 4, 32), (2, 4), 4),  # block-major NHD: gathered per (K or V, head)
        ((TP_BLOCKS, 2, 4, 16, 32), (2, 4), 4),  # block-major HND: per (head, K or V)
    ],
)
def test_scale_groups_of_a_head_range(shape: tuple[int, ...], heads: tuple[int, int], groups: int) -> None:
    geometry = Geometry(block_size=16, num_kv_heads=4, head_dim=32)
    kv = PagedKV({"a": torch.zeros(shape)}, TP_BLOCKS, geometry)
    assert kv.groups(heads) == groups
    per_block = kv.batch_shape(1, heads)
    assert (per_block[0] * int(torch.tensor(per_block[1:]).prod())) % groups == 0


def test_head_ranges_need_a_layout_that_shows_the_heads() -> None:
    ambiguous = Geometry(block_size=16, num_kv_heads=16, head_dim=32)
    assert layer_layout(torch.zeros(TP_BLOCKS, 16, 16, 64), TP_BLOCKS, ambiguous).head_axis is None
    kv = PagedKV({"a": torch.zeros(TP_BLOCKS, 16, 16, 64)}, TP_BLOCKS, ambiguous)
    with pytest.raises(LayoutError, match="cannot address KV head sub-ranges"):
        kv.spans([1], heads=(0, 8))
    cpu = rank_kv(None, "cpu", TPRank(0, 2))
    with pytest.raises(LayoutError, match=r"KV heads 4\.\.5 are not all on this rank \(it holds 0\.\.3\)"):
        cpu.local_heads((4, 6))


def test_signatures_match_across_tp_sizes_and_name_the_model_heads() -> None:
    for layout in LAYOUTS:
        one, half = rank_kv(None, layout, TPRank(0, 1)), rank_kv(None, layout, TPRank(1, 2))
        assert one.signature() == half.signature()
        assert one.signature()["num_kv_heads"] == 8
    other = Geometry(block_size=16, num_kv_heads=4, head_dim=32, model="tiny-tp-test", total_kv_heads=4)
    fewer = PagedKV({"a": torch.zeros(TP_BLOCKS, 4, 16, 64, dtype=torch.bfloat16)}, TP_BLOCKS, other)
    assert fewer.signature()["num_kv_heads"] == 4
    # a rank of TP 2 with 4 of 8 heads against a model with 4 heads in all: the totals differ
    half_signature = rank_kv(None, "cpu", TPRank(0, 2)).signature() | {"layers": 1}
    assert signature_mismatches(half_signature, fewer.signature()) == ["num_kv_heads: ours 8, peer 4"]
    wider = Geometry(block_size=16, num_kv_heads=4, head_dim=64, model="tiny-tp-test", total_kv_heads=8)
    other_dim = PagedKV(
        {"a": torch.zeros(TP_BLOCKS, 4, 16, 128, dtype=torch.bfloat16)}, TP_BLOCKS, wider, tp=TPRank(1, 2)
    )
    assert "head_dim: ours 32, peer 64" in signature_mismatches(half_signature, other_dim.signature())
