"""What the KV codec tests share: the scale groups per block, the codecs that quantize, the
checksum algorithms, small random blocks, every finite value of a dtype with edge groups, and the
error a quantized round trip may make."""

from __future__ import annotations

import torch

from dllm_connector import codec
from dllm_contract.kvconfig import Compression

GROUPS = 4  # 2 KV heads x (K, V) per block
QUANTIZED = (Compression.FP8, Compression.INT8)
NH64 = codec.ChecksumAlgo.NH64
XXH3 = codec.ChecksumAlgo.XXH3_64


def blocks(*, num_blocks: int = 6, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, GROUPS, 16, 8, generator=generator).to(dtype)


def group_amax(kv: torch.Tensor) -> torch.Tensor:
    return kv.float().abs().reshape(kv.shape[0] * GROUPS, -1).amax(dim=1)


def error_bound(kv: torch.Tensor, compression: Compression) -> torch.Tensor:
    """Per-element bound: the 8-bit code's rounding plus rounding back to the KV dtype."""
    scale = (group_amax(kv) / codec.QMAX[compression]).repeat_interleave(kv[0].numel() // GROUPS)
    x = kv.float().reshape(-1).abs()
    out_rounding = x * torch.finfo(kv.dtype).eps
    if compression is Compression.FP8:
        # 3 mantissa bits; subnormal steps of 2^-9 of the power-of-two scale, which is < 2 amax / 448
        code_rounding = torch.maximum(x * 2.0**-4, scale * 2.0**-9)
    else:
        code_rounding = scale / 2
    return (code_rounding + out_rounding) * 1.01 + 1e-30


def adversarial_blocks(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit dtype (a sample of float32's), shuffled into groups, plus groups
    of zeros, of the dtype's subnormals, at its largest finite values and at exact powers of two."""
    generator = torch.Generator().manual_seed(7)
    if dtype is torch.float32:
        patterns = torch.randint(-(1 << 31), 1 << 31, (1 << 16,), generator=generator, dtype=torch.int64)
        values = patterns.to(torch.int32).view(torch.float32)
    else:
        values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    values = values[torch.randperm(values.numel(), generator=generator)]
    info = torch.finfo(dtype)
    group = 16 * 8
    special = [
        torch.zeros(group),
        torch.full((group,), info.tiny) * torch.rand(group, generator=generator),  # subnormal
        torch.full((group,), info.max) * (1 - torch.rand(group, generator=generator) / 16),
        torch.full((group,), info.max).neg(),
        2.0 ** torch.randint(-20, 20, (group,), generator=generator).float(),
    ]
    groups = values[: values.numel() // group * group].reshape(-1, group)
    rows = torch.cat([groups, torch.stack(special).to(dtype)])
    rows = rows[: rows.shape[0] // GROUPS * GROUPS]
    return rows.reshape(-1, GROUPS, 16, 8).contiguous()
