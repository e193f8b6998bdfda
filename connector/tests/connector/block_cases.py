"""Caches of every layout the connector takes, small, for the zero-copy checksum's in-place tests."""

from __future__ import annotations

import torch

from dllm_connector.codec.device_checksum import RunningTensorChecksum
from dllm_connector.layout import Geometry, PagedKV

NUM_BLOCKS, BLOCK, HEADS, DIM, MLA_DIM = 12, 16, 4, 32, 576
GEOMETRY = Geometry(block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)
MLA = Geometry(block_size=BLOCK, num_kv_heads=1, head_dim=MLA_DIM)
BLOCKS = [7, 2, 11, 0, 5]
HEAD_RANGES: list[tuple[int, int] | None] = [None, (1, 3)]


def random_cache(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def layout_kv(layout: str) -> PagedKV:
    """Two layers of one layout: FlashAttention's NHD ([2, N, T, H, D]: K and V apart), HND as vLLM
    hands it (a permuted view), the CPU's ([N, H, T, 2D]) or MLA's latent ([N, T, 576])."""
    if layout == "nhd":
        caches = {f"l{i}": random_cache((2, NUM_BLOCKS, BLOCK, HEADS, DIM), i) for i in (1, 2)}
    elif layout == "hnd":
        shape = (2, NUM_BLOCKS, HEADS, BLOCK, DIM)
        caches = {f"l{i}": random_cache(shape, i).permute(0, 1, 3, 2, 4) for i in (3, 4)}
    elif layout == "cpu":
        caches = {f"l{i}": random_cache((NUM_BLOCKS, HEADS, BLOCK, 2 * DIM), i) for i in (5, 6)}
    else:
        return PagedKV(
            {f"l{i}": random_cache((NUM_BLOCKS, BLOCK, MLA_DIM), i) for i in (7, 8)}, NUM_BLOCKS, MLA
        )
    return PagedKV(caches, NUM_BLOCKS, GEOMETRY)


def gathered_value(kv: PagedKV, heads: tuple[int, int] | None, prefix: torch.Tensor) -> int:
    """The zero-copy checksum as the gather gives it: `prefix`, then every layer's blocks."""
    running = RunningTensorChecksum()
    running.add(prefix)
    for run in kv.gathered_bytes(BLOCKS, heads, range(kv.num_layers), 1 << 20):
        running.add(run)
    return running.value
