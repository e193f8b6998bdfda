"""KV codecs: round trips with bounded error, adversarial values, headers and checksums."""

from __future__ import annotations

import pytest
import torch

from dllm_connector import codec
from dllm_connector.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

GROUPS = 4  # 2 KV heads x (K, V) per block
QUANTIZED = (Compression.FP8, Compression.INT8)


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
    if compression is Compression.FP8:  # 3 mantissa bits; subnormal spacing 2^-9 of the scale
        code_rounding = torch.maximum(x * 2.0**-4, scale * 2.0**-10)
    else:
        code_rounding = scale / 2
    return (code_rounding + out_rounding) * 1.01 + 1e-30


@pytest.mark.parametrize("compression", list(Compression))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_error_is_bounded(compression: Compression, dtype: torch.dtype) -> None:
    kv = blocks(dtype=dtype) * 3
    header, payload = codec.encode(kv, compression, GROUPS)
    restored = codec.decode(header, payload)
    assert restored.dtype == dtype
    assert restored.shape == kv.shape
    error = (restored.float() - kv.float()).reshape(-1).abs()
    if compression is Compression.NONE:
        assert torch.equal(restored, kv)
    else:
        assert bool((error <= error_bound(kv, compression)).all()), float(error.max())
        relative = float(error.norm() / kv.float().norm())
        assert relative < {Compression.FP8: 0.04, Compression.INT8: 0.01}[compression]


@pytest.mark.parametrize("compression", QUANTIZED)
def test_quantized_payload_is_about_half_of_bf16(compression: Compression) -> None:
    kv = blocks(num_blocks=32)
    header, payload = codec.encode(kv, compression, GROUPS)
    assert payload.numel() == header.payload_nbytes
    assert payload.numel() <= 0.55 * kv.numel() * kv.element_size()
    assert header.raw_nbytes == kv.numel() * kv.element_size()


def test_scales_are_per_block_head_and_k_or_v() -> None:
    """A group of huge values does not flatten the precision of its small neighbours."""
    kv = blocks()
    kv[2, 1] *= 1e4  # one block's one head's K
    header, payload = codec.encode(kv, Compression.INT8, GROUPS)
    restored = codec.decode(header, payload)
    neighbours = [(b, g) for b in range(kv.shape[0]) for g in range(GROUPS) if (b, g) != (2, 1)]
    for b, g in neighbours:
        error = (restored[b, g].float() - kv[b, g].float()).abs().max()
        assert float(error) <= float(kv[b, g].float().abs().max()) / 127
    assert header.num_scales == kv.shape[0] * GROUPS


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


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("compression", list(Compression))
def test_fp8_kv_cache_passes_through_unchanged(kv_dtype: torch.dtype, compression: Compression) -> None:
    kv = blocks().to(kv_dtype)
    header, payload = codec.encode(kv, compression, GROUPS)
    assert header.codec is Compression.NONE
    assert payload.numel() == kv.numel()
    assert torch.equal(codec.as_bytes(codec.decode(header, payload)), codec.as_bytes(kv))


@pytest.mark.parametrize("compression", list(Compression))
def test_corrupted_payload_fails_its_checksum(compression: Compression) -> None:
    header, payload = codec.encode(blocks(), compression, GROUPS)
    payload[payload.numel() // 2] ^= 0x10
    with pytest.raises(codec.ChecksumError, match="checksum"):
        codec.decode(header, payload)


def test_short_payload_is_refused() -> None:
    header, payload = codec.encode(blocks(), Compression.FP8, GROUPS)
    with pytest.raises(codec.CodecError, match=r"payload has \d+ bytes, header says"):
        codec.decode(header, payload[:-1])


def test_header_round_trips_and_predicts_the_payload_size() -> None:
    kv = blocks()
    header, payload = codec.encode(kv, Compression.FP8, GROUPS)
    assert codec.KVHeader.from_dict(header.to_dict()) == header
    predicted = codec.payload_nbytes(Compression.FP8, kv.dtype, tuple(kv.shape), GROUPS)
    assert predicted == payload.numel()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 9}, "header version 9"),
        ({"codec": "zstd"}, "malformed KV header"),
        ({"dtype": "float64"}, "unsupported KV dtype 'float64'"),
        ({"shape": [0, 4]}, "every size > 0"),
        ({"groups": 3}, "3 scale groups do not divide"),
        ({"checksum": "x"}, "malformed KV header"),
    ],
)
def test_malformed_headers_are_refused(change: dict[str, object], message: str) -> None:
    raw = codec.encode(blocks(), Compression.INT8, GROUPS)[0].to_dict() | change
    with pytest.raises(codec.CodecError, match=message):
        codec.KVHeader.from_dict(raw)


def test_missing_header_key_is_refused() -> None:
    raw = codec.encode(blocks(), Compression.INT8, GROUPS)[0].to_dict()
    del raw["shape"]
    with pytest.raises(codec.CodecError, match="malformed KV header"):
        codec.KVHeader.from_dict(raw)


def test_encode_writes_into_a_staging_buffer() -> None:
    kv = blocks()
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    header, payload = codec.encode(kv, Compression.FP8, GROUPS, out=staging)
    assert payload.data_ptr() == staging.data_ptr()
    assert torch.equal(codec.decode(header, staging), codec.decode(header, payload.clone()))


def test_too_small_staging_buffer_is_refused() -> None:
    with pytest.raises(codec.CodecError, match="at least"):
        codec.encode(blocks(), Compression.NONE, GROUPS, out=torch.zeros(8, dtype=torch.uint8))


def test_decode_into_a_wrong_target_is_refused() -> None:
    header, payload = codec.encode(blocks(), Compression.INT8, GROUPS)
    with pytest.raises(codec.CodecError, match="decode target"):
        codec.decode(header, payload, out=torch.empty(2, 2, dtype=torch.bfloat16))


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(codec.CodecError, match="unsupported KV dtype"):
        codec.encode(torch.zeros(2, 4, dtype=torch.float64), Compression.FP8, 1)


def test_non_contiguous_blocks_are_refused() -> None:
    kv = blocks().transpose(2, 3)
    with pytest.raises(codec.CodecError, match="contiguous"):
        codec.encode(kv, Compression.NONE, GROUPS)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("compression", QUANTIZED)
def test_compiled_kernels_match_plain_ones(compression: Compression) -> None:
    kv = blocks(num_blocks=16)
    try:
        plain = codec.use_compiled(False)
        expected = codec.encode(kv, compression, GROUPS)
        compiled = codec.use_compiled(True)
        if not compiled:
            pytest.skip("torch.compile is unavailable here; the plain kernels are in use")
        header, payload = codec.encode(kv, compression, GROUPS)
        restored = codec.decode(header, payload)
    finally:
        codec.use_compiled(False)
    assert not plain
    reference = codec.decode(*expected)
    assert float((restored.float() - reference.float()).abs().max()) <= float(
        error_bound(kv, compression).max()
    )


@pytest.mark.parametrize("compression", list(Compression))
def test_encode_leaves_the_kv_untouched(compression: Compression) -> None:
    kv = blocks(dtype=torch.float32)
    before = kv.clone()
    codec.encode(kv, compression, GROUPS)
    assert torch.equal(kv, before)


def test_fp8_bit_pattern_decode_is_exact_for_every_finite_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, 256)
    want = codes.float()
    finite = torch.isfinite(want)
    got = codec._dequantize_fp8_bits(codes, torch.ones(1))
    assert torch.equal(got[finite], want[finite])
