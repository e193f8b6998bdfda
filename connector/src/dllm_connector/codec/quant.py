"""fp8 (e4m3, power-of-two scales) and int8 quantization of rows, in torch ops."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm_connector.codec.header import MIN_SCALE

ScalesFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
CodesFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
ValuesFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor], None]


# ---- kernels -------------------------------------------------------------------------------------
#
# Each codec has two kernels on a chunk of rows (one row = one scale group): `encode_into` (rows ->
# 8-bit codes and one scale per row, written straight into the payload) and `decode_into` (codes ->
# values in the KV dtype, written into the target). The torch ones encode in two steps: `scales` (per
# row: the reciprocal used to encode, and the scale the payload carries), then `codes`. Compiled,
# torch.compile fuses each step into one loop (fp8's decode into two, over whole int32 words); plain
# torch ops use torch's fp8 casts instead of the integer ops, which unfused would cost a pass each.
# The C kernels (kvcodec.c) do each row's amax and codes in one call, the same arithmetic per element.
# All give the same bytes (tests check it).
#
# fp8 uses power-of-two scales 2^k, the smallest with amax * 2^-k <= 448. Multiplying by 2^-k is
# exact, and the float32 -> e4m3 rounding is then done with integer ops on the float32 bit pattern,
# which vectorizes where torch's scalar fp8 cast does not. A floating-point code loses almost nothing
# to a power-of-two scale: its relative error is set by its 3 mantissa bits; only the subnormal range
# moves up by at most one binade (see the error bound in docs/kv-connector.md).

_FLOAT32_EXP_MASK = 0x7F800000  # bits at or above: inf or NaN
_E4M3_MIN_NORMAL_BITS = 121 << 23  # float32 bits of 2^-6, the smallest normal e4m3
_E4M3_REBIAS = 120 << 3  # exponent bias 127 -> 7, in units of the code's exponent field
_SUBNORMAL_ROUNDER = 16384.0  # 2^14: its float32 ulp is 2^-9, e4m3's subnormal step
_SUBNORMAL_ROUNDER_BITS = 0x46800000


def fp8_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: 2^-k and the scale 2^k, the smallest power of two with amax * 2^-k <= 448.

    amax = 1.f * 2^(e - 127) and 448 = 1.75 * 2^8, so k = e - 135, plus one where f > .75. k stays
    >= -126 (the smallest normal float32 scale, also that of an all-zero row). A row holding NaN or
    inf gets a NaN scale, which encode refuses.
    """
    bits = rows.abs().amax(dim=1).float().view(torch.int32)
    k = ((bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)).clamp(min=-126)
    inverse = ((127 - k) << 23).view(torch.float32)
    scale = ((127 + k) << 23).view(torch.float32)
    return inverse, torch.where(bits >= _FLOAT32_EXP_MASK, float("nan"), scale)


def fp8_codes(rows: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    """e4m3 codes of rows * inverse, rounded to nearest even, written into out (uint8)."""
    x = rows.float()
    scaled = x.abs() * inverse.unsqueeze(1)  # exact (a power of two), at most 448
    bits = scaled.view(torch.int32)
    # Normal range: round the float32 mantissa to 3 bits (ties to even); a carry moves the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - _E4M3_REBIAS
    # Subnormal range (below 2^-6, steps of 2^-9): the float add rounds to the step.
    subnormal = (scaled + _SUBNORMAL_ROUNDER).view(torch.int32) - _SUBNORMAL_ROUNDER_BITS
    code = torch.where(bits < _E4M3_MIN_NORMAL_BITS, subnormal, normal).clamp(max=0x7E)
    code = code | ((x.view(torch.int32) >> 24) & 0x80)
    # int32 -> uint8 has no vector conversion on AVX2, float32 -> uint8 has: faster through float
    # (docs/kv-connector.md, Codec).
    out.copy_(code.float().to(torch.uint8))


def fp8_values(codes: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    """e4m3 codes times their row's scale, as float32: exact for every finite code.

    e4m3's 7 magnitude bits placed at float16 bits 13..7 give the same value times 2^-8 (exponent
    bias 15 vs 7), subnormals included; float16 -> float32 vectorizes where the fp8 cast does not.
    The two NaN codes, which encode never writes, read as +-480. A value beyond the KV dtype's range
    (a group at that range's top whose largest code rounded up) saturates at `limit`, never inf.
    """
    bits = codes.to(torch.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(torch.int16).view(torch.float16)
    # Times 2^8 first: exact, where scale * 2^8 could overflow for a scale near float32's top.
    return (half.float() * 256.0 * scale.unsqueeze(1)).clamp(-limit, limit)


def fp8_half_words(words: torch.Tensor) -> torch.Tensor:
    """The float16 bits `fp8_values` builds, four codes per int32 word: reading whole words avoids
    inductor's slow byte loads on AVX2. Returns [words, 2] int32 holding the float16 in code order."""
    even = words & 0x00FF00FF  # codes 0 and 2 of each word, one per 16-bit lane
    odd = (words >> 8) & 0x00FF00FF  # codes 1 and 3
    even = ((even & 0x00800080) << 8) | ((even & 0x007F007F) << 7)
    odd = ((odd & 0x00800080) << 8) | ((odd & 0x007F007F) << 7)
    low = (even & 0xFFFF) | (odd << 16)  # codes 0, 1
    high = ((even >> 16) & 0xFFFF) | (odd & -0x10000)  # codes 2, 3
    return torch.stack([low, high], dim=-1)


def fp8_widen_into(half: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
    """float16 (from `fp8_half_words`) times 2^8 and the row's scale, cast into out in the same pass."""
    out.copy_((half.float() * 256.0 * scale.unsqueeze(1)).clamp(-limit, limit))


def fp8_decode_by_words(half_words: Callable[[torch.Tensor], torch.Tensor], widen_into: DecodeFn) -> DecodeFn:
    """`fp8_values` into out in two passes over whole int32 words (rows of a multiple of 4 codes)."""

    def decode_into(codes: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
        if codes.shape[-1] % 4 or not codes.is_contiguous() or codes.data_ptr() % 4:
            out.copy_(fp8_values(codes, scale, limit))
            return
        half = half_words(codes.view(torch.int32)).view(torch.float16).view(codes.shape)
        widen_into(half, scale, limit, out)

    return decode_into


def decoding_with(values: ValuesFn) -> DecodeFn:
    """A decode into out from a kernel that returns float32 (the copy casts to the KV dtype)."""

    def decode_into(codes: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
        out.copy_(values(codes, scale, limit))

    return decode_into


def fp8_codes_cast(rows: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    """The same codes through torch's float32 -> e4m3 cast: one op, faster than the integer ops
    when they cannot be fused (plain torch ops)."""
    out.view(torch.float8_e4m3fn).copy_(torch.mul(rows, inverse.unsqueeze(1)))


def fp8_values_cast(codes: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    """Through torch's e4m3 -> float32 cast. The two NaN codes, which encode never writes but a peer
    can (L3), read as +-448 (the cast would give NaN): never a NaN in the cache. The C and compiled
    kernels read them as +-480; only a forged payload can tell."""
    finite = codes ^ ((codes & 0x7F) == 0x7F)  # 0x7F -> 0x7E, 0xFF -> 0xFE: three passes of bytes
    return finite.view(torch.float8_e4m3fn).float().mul_(scale.unsqueeze(1)).clamp_(-limit, limit)


def int8_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: 127 / amax and the scale amax / 127 (NaN or inf for a row holding them).

    Divided by a tensor, not a Python float: CUDA turns `t / 127.0` into `t * fl32(1/127)`, which rounds
    a few percent of bf16 maxima one ulp below the host's and the C kernel's true quotient
    (gpu-review item 1)."""
    amax = rows.abs().amax(dim=1).float()
    scale = torch.div(amax, torch.full_like(amax, 127.0)).clamp(min=MIN_SCALE)
    return scale.reciprocal(), scale


def int8_codes(rows: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_((rows.float() * inverse.unsqueeze(1)).clamp(-127.0, 127.0).round().to(torch.int8))


def int8_decode_into(codes: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
    """codes * scale in float32, rounded into out's dtype by the multiply's store (as a copy would,
    one pass fewer over the values, which a device's memory feels). Eager on purpose: int8 -> float
    is vectorized in eager torch and beat a compiled kernel."""
    torch.mul(codes.float(), scale.unsqueeze(1), out=out)
