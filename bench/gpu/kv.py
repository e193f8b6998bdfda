"""The KV every check runs on: a 32-layer model's, bf16, gathered as the pipe gathers a batch."""

from __future__ import annotations

from typing import Any

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def make_kv(tokens: int, device: Any) -> Any:
    """The KV of `tokens` gathered as the pipe gathers a batch: [layers * blocks * (K, V), heads,
    block, head_dim], one scale group per (block, head, K or V)."""
    import torch

    blocks = -(-tokens // BLOCK)
    generator = torch.Generator(device=device).manual_seed(tokens)
    shape = (LAYERS * blocks * 2, KV_HEADS, BLOCK, HEAD_DIM)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)


def with_edge_groups(sample: Any) -> Any:
    """A copy with groups of each kind the kernels treat apart: zeros, subnormals, the dtype's
    largest values and powers of two (every other group random)."""
    import torch

    sample = sample.clone()
    info = torch.finfo(sample.dtype)
    ramp = torch.linspace(-1.0, 1.0, BLOCK * HEAD_DIM, device=sample.device).view(BLOCK, HEAD_DIM)
    sample[0, 0] = 0.0
    sample[1, 1] = ramp * info.tiny
    sample[2, 2] = ramp * info.max
    powers = 2.0 ** torch.arange(-8, 8, device=sample.device).float()
    sample[3, 3] = powers.repeat(HEAD_DIM).view(BLOCK, HEAD_DIM)
    return sample
