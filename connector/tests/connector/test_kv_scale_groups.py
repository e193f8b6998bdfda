"""fp8/int8 scale groups follow the KV heads on every layout that has them (issue 35, gpu-review item
15): on FlashAttention's token-major cache ([2, N, T, H, D], the H100 default) a gathered segment holds
one head after another, so each head gets its own scale, as on the CPU and head-major layouts."""

from __future__ import annotations

import pytest
import torch

from dllm_connector import codec
from dllm_connector.layout import Geometry, PagedKV
from dllm_contract.kvconfig import Compression

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS, BLOCK, HEADS, DIM = 10, 16, 4, 32
GEOMETRY = Geometry(block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)
IDS, PLACES = [1, 6, 7], [3, 8, 0]


def token_major(*, spread: bool = False) -> torch.Tensor:
    """[2, N, T, H, D] as FlashAttention allocates it; with `spread`, head h's values are 10^-h in size
    (real KV holds heads of very different magnitudes)."""
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    if spread:
        cache *= torch.tensor([10.0**-head for head in range(HEADS)]).view(1, 1, 1, HEADS, 1)
    return cache


def test_a_token_major_cache_is_gathered_one_head_after_another_and_placed_back_exactly() -> None:
    cache, target = token_major(), torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    source = PagedKV({"a": cache}, NUM_BLOCKS, GEOMETRY)
    assert source.layout.heads_outermost
    assert (source.layout.segments, source.layout.groups) == (2, HEADS)  # K and V apart, a group per head
    batch = source.gather(IDS)
    # [blocks x (K, V), H, T, D]: each head's tokens contiguous
    assert torch.equal(batch.view(len(IDS), 2, HEADS, BLOCK, DIM), cache[:, IDS].permute(1, 0, 3, 2, 4))
    PagedKV({"a": target}, NUM_BLOCKS, GEOMETRY).scatter(PLACES, batch)
    assert torch.equal(target[:, PLACES], cache[:, IDS])
    untouched = [block for block in range(NUM_BLOCKS) if block not in PLACES]
    assert not bool(target[:, untouched].any())


def test_a_head_range_of_a_token_major_cache_moves_to_the_same_heads() -> None:
    """A peer of another TP size takes a head range; gathered head-major, placed token-major."""
    cache, target = token_major(), torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    source, sink = PagedKV({"a": cache}, NUM_BLOCKS, GEOMETRY), PagedKV({"a": target}, NUM_BLOCKS, GEOMETRY)
    heads = (1, 3)
    assert source.groups(heads) == 2
    sink.scatter(PLACES, source.gather(IDS, heads=heads), heads=heads)
    assert torch.equal(target[:, PLACES, :, 1:3], cache[:, IDS, :, 1:3])
    assert not bool(target[:, :, :, [0, 3]].any())


def test_flashinfers_token_major_cache_gets_a_group_per_head_and_k_or_v() -> None:
    """[N, 2, T, H, D]: one segment per block holding K and V."""
    cache = torch.randn(NUM_BLOCKS, 2, BLOCK, HEADS, DIM)
    target = torch.zeros_like(cache)
    source = PagedKV({"a": cache}, NUM_BLOCKS, GEOMETRY)
    assert (source.layout.segments, source.layout.groups) == (1, 2 * HEADS)
    PagedKV({"a": target}, NUM_BLOCKS, GEOMETRY).scatter(PLACES, source.gather(IDS))
    assert torch.equal(target[PLACES], cache[IDS])


@pytest.mark.parametrize("compression", [Compression.INT8, Compression.FP8])
def test_a_small_heads_error_is_bounded_by_its_own_size_not_the_largest_heads(
    compression: Compression,
) -> None:
    """With one scale over all heads of a block (before), a head 1000x smaller than the largest lost
    every int8 code; now each head's error is bounded by its own largest value."""
    cache, target = token_major(spread=True), torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    source, sink = PagedKV({"a": cache}, NUM_BLOCKS, GEOMETRY), PagedKV({"a": target}, NUM_BLOCKS, GEOMETRY)
    header, payload = codec.encode(source.gather(IDS), compression, source.layout.groups)
    sink.scatter(PLACES, codec.decode(header, payload))
    # int8: half a step of amax / 127; e4m3: 3 mantissa bits (2^-4 relative) above its subnormals,
    # whose step 2^-9 of the group's power-of-two scale (< 2 amax / 448) stays under amax / 256
    bound = 1 / 254 if compression is Compression.INT8 else 1 / 16
    for head in range(HEADS):
        sent, got = cache[:, IDS, :, head], target[:, PLACES, :, head]
        error = (got - sent).abs()
        if compression is Compression.INT8:
            assert float(error.max()) <= float(sent.abs().amax(dim=(1, 2, 3)).max()) * bound * 1.0001, head
        else:
            assert bool((error <= sent.abs() * bound + float(sent.abs().max()) / 224).all()), head
