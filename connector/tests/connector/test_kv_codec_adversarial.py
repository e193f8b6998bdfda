"""The codec on adversarial KV values: zeros, subnormals, huge values and every finite value of a
dtype decode finite within the bound, fp8 codes are the nearest e4m3 over a power-of-two scale, and
NaN or inf is refused by the quantized codecs and carried bit exact by none."""

from __future__ import annotations

import pytest
import torch
from codec_cases import GROUPS, QUANTIZED, adversarial_blocks, blocks, error_bound, group_amax

from dllm_connector import codec
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]


@pytest.mark.parametrize("compression", list(Compression))
def test_all_zero_kv_decodes_to_zeros_without_nan(compression: Compression) -> None:
    kv = torch.zeros(3, GROUPS, 16, 8, dtype=torch.bfloat16)
    header, payload = codec.encode(kv, compression, GROUPS)
    restored = codec.decode(header, payload)
    assert torch.equal(restored, kv)


@pytest.mark.parametrize("compression", QUANTIZED)
def test_subnormal_and_huge_groups_stay_finite(compression: Compression) -> None:
    kv = blocks(num_blocks=2, dtype=torch.float32)
    kv[0] = torch.finfo(torch.bfloat16).tiny / 64  # subnormal in bf16 terms
    kv[1] = kv[1].sign() * torch.finfo(torch.float32).max / 2
    header, payload = codec.encode(kv, compression, GROUPS)
    restored = codec.decode(header, payload)
    assert bool(torch.isfinite(restored).all())
    huge_error = (restored[1] - kv[1]).abs().max() / kv[1].abs().max()
    assert float(huge_error) < 0.07


@pytest.mark.parametrize("compression", QUANTIZED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_cannot_be_quantized(compression: Compression, bad: float) -> None:
    kv = blocks()
    kv[4, 3, 0, 0] = bad
    with pytest.raises(codec.NonFiniteKVError, match="1 of 24 scale groups hold NaN or inf"):
        codec.encode(kv, compression, GROUPS)


def test_codec_none_carries_nan_and_inf_bit_exact() -> None:
    kv = blocks()
    kv[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    header, payload = codec.encode(kv, Compression.NONE, GROUPS)
    restored = codec.decode(header, payload)
    assert torch.equal(codec.as_bytes(restored), codec.as_bytes(kv))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_codes_are_the_nearest_even_e4m3_of_x_over_a_power_of_two_scale(dtype: torch.dtype) -> None:
    kv = adversarial_blocks(dtype)
    header, payload = codec.encode(kv, Compression.FP8, GROUPS)
    codes = payload[: header.data_nbytes].view(kv.shape[0] * GROUPS, -1)
    scale = payload[header.data_nbytes :].view(torch.float32)
    mantissa = scale.view(torch.int32) & 0x7FFFFF
    assert bool((mantissa == 0).all()), "every scale is a power of two"
    amax = group_amax(kv)
    nonzero = amax > 0
    ratio = amax[nonzero] / scale[nonzero]
    assert bool((ratio <= 448).all())
    # The largest code uses the top binade, unless the scale is pinned at the smallest normal float32.
    assert bool(((ratio > 224) | (scale[nonzero] == torch.finfo(torch.float32).tiny)).all())
    reference = (kv.float().reshape(codes.shape) / scale.unsqueeze(1)).to(torch.float8_e4m3fn)
    assert torch.equal(codes, reference.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("compression", QUANTIZED)
def test_adversarial_values_decode_finite_within_the_bound(
    compression: Compression, dtype: torch.dtype
) -> None:
    kv = adversarial_blocks(dtype)
    restored = codec.decode(*codec.encode(kv, compression, GROUPS))
    assert bool(torch.isfinite(restored).all()), "values at the dtype's maximum saturate, never inf"
    error = (restored.float() - kv.float()).reshape(-1).abs()
    assert bool((error <= error_bound(kv, compression)).all()), float(error.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_in_any_dtype_raises(dtype: torch.dtype, bad: float) -> None:
    kv = adversarial_blocks(dtype)
    kv[1, 2, 3, 4] = bad
    kv[-1, 0, 0, 0] = bad
    with pytest.raises(codec.NonFiniteKVError, match=f"2 of {kv.shape[0] * GROUPS} scale groups"):
        codec.encode(kv, Compression.FP8, GROUPS)


def test_scales_of_an_all_zero_group_are_the_smallest_normal_float32() -> None:
    kv = torch.zeros(2, GROUPS, 16, 8, dtype=torch.float16)
    header, payload = codec.encode(kv, Compression.FP8, GROUPS)
    scale = payload[header.data_nbytes :].view(torch.float32)
    assert bool((scale == torch.finfo(torch.float32).tiny).all())
