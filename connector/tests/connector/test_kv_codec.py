"""KV codecs: round trips with bounded error, adversarial values, headers and checksums."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import struct
from collections.abc import Callable, Iterator

import pytest
import torch
import xxhash

from dllm_connector import codec
from dllm_connector.codec import native as native_codec
from dllm_connector.codec import quant
from dllm_connector.codec.kernel_sets import native_kernels
from dllm_connector.layout import Geometry, PagedKV
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

GROUPS = 4  # 2 KV heads x (K, V) per block
COMPILER = shutil.which("cc") or shutil.which("gcc")
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
    if compression is Compression.FP8:
        # 3 mantissa bits; subnormal steps of 2^-9 of the power-of-two scale, which is < 2 amax / 448
        code_rounding = torch.maximum(x * 2.0**-4, scale * 2.0**-9)
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


@pytest.mark.parametrize("compression", list(Compression))
def test_a_batch_encoded_and_decoded_in_parts_matches_the_whole(compression: Compression) -> None:
    kv = blocks(num_blocks=6)
    whole_header, whole_payload = codec.encode(kv, compression, GROUPS)
    reused = torch.empty(2, *kv.shape[1:], dtype=kv.dtype)  # parts overwrite one buffer, as a gather does
    header, payload = codec.encode_parts(
        _copies_into(reused, kv.chunk(3)), tuple(kv.shape), kv.dtype, compression, GROUPS
    )
    assert header == whole_header
    assert torch.equal(payload, whole_payload)
    parts = [part.clone() for part in codec.decode_parts(header, payload, 3)]
    assert torch.equal(torch.cat(parts), codec.decode(whole_header, whole_payload))


@pytest.mark.parametrize("compression", list(Compression))
def test_a_payload_decoded_as_its_parts_arrive_matches_and_is_verified(compression: Compression) -> None:
    kv = blocks(num_blocks=6)
    filled: list[list[tuple[int, int]]] = []
    header, payload = codec.encode_parts(
        kv.chunk(3), tuple(kv.shape), kv.dtype, compression, GROUPS, on_part=filled.append
    )
    assert header.checksum == codec.checksum(header, payload)
    # Each part reports its data (and scales) ranges once: together, the whole payload.
    covered = sorted(span for ranges in filled for span in ranges)
    assert covered[0][0] == 0
    assert covered[-1][1] == header.payload_nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    stream = codec.StreamingDecode(header, payload, 3)
    parts = [part.clone() for part in stream.parts_until(1)] + [
        part.clone() for part in stream.parts_until(3)
    ]
    stream.verify(header.checksum)
    assert torch.equal(torch.cat(parts), codec.decode(header, payload))


@pytest.mark.parametrize("where", ["data", "scales"])
def test_a_payload_decoded_as_its_parts_arrive_fails_verify_when_corrupted(where: str) -> None:
    header, payload = codec.encode(blocks(), Compression.FP8, GROUPS)
    payload[3 if where == "data" else header.data_nbytes + 1] ^= 0x10
    stream = codec.StreamingDecode(header, payload, 2)
    for _ in stream.parts_until(2):
        pass
    with pytest.raises(codec.ChecksumError):
        stream.verify(header.checksum)


def test_a_payload_is_verified_only_after_all_its_parts() -> None:
    header, payload = codec.encode(blocks(), Compression.INT8, GROUPS)
    stream = codec.StreamingDecode(header, payload, 3)
    for _ in stream.parts_until(1):
        pass
    with pytest.raises(codec.CodecError, match="after 1 of 3 parts"):
        stream.verify(header.checksum)


def _copies_into(buffer: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
    for part in parts:
        buffer.copy_(part)
        yield buffer


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([torch.zeros(2, GROUPS, 16, 8, dtype=torch.bfloat16)], "parts held 2 of the batch's 6 entries"),
        (
            [torch.zeros(4, GROUPS, 16, 8, dtype=torch.bfloat16)] * 2,
            "parts hold more than the batch's 6 entries",
        ),
        (
            [torch.zeros(6, GROUPS, 8, 16, dtype=torch.bfloat16)],
            r"part \[6, 4, 8, 16\] torch.bfloat16 does not fit batch \[6, 4, 16, 8\]",
        ),
        ([torch.zeros(6, GROUPS, 16, 8, dtype=torch.float16)], "does not fit batch"),
    ],
)
def test_parts_that_do_not_make_up_the_batch_are_refused(parts: list[torch.Tensor], message: str) -> None:
    with pytest.raises(codec.CodecError, match=message):
        codec.encode_parts(parts, (6, GROUPS, 16, 8), torch.bfloat16, Compression.FP8, GROUPS)


def test_decoding_in_parts_needs_parts_that_divide_the_batch() -> None:
    header, payload = codec.encode(blocks(num_blocks=6), Compression.FP8, GROUPS)
    with pytest.raises(codec.CodecError, match="a batch of 6 entries does not split into 4 parts"):
        next(codec.decode_parts(header, payload, 4))


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


@pytest.mark.parametrize("compression", list(Compression))
def test_checksum_is_xxh3_of_the_data_combined_with_that_of_the_scales(compression: Compression) -> None:
    """Pinned to the wire format (KV header version 2), which a peer of another build must agree on."""
    header, payload = codec.encode(blocks(), compression, GROUPS)
    data = xxhash.xxh3_64_intdigest(payload[: header.data_nbytes].numpy().tobytes())
    if compression is Compression.NONE:
        assert header.checksum == data
    else:
        scales = xxhash.xxh3_64_intdigest(payload[header.data_nbytes :].numpy().tobytes())
        assert header.checksum == xxhash.xxh3_64_intdigest(struct.pack("<2Q", data, scales))


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
        ({"checksum": "x"}, "checksum must be an integer, not str"),
        ({"checksum": "5"}, "checksum must be an integer, not str"),
        ({"checksum": 5.9}, "checksum must be an integer, not float"),
        ({"checksum": True}, "checksum must be an integer, not bool"),
        ({"checksum": -1}, "checksum must be a 64-bit unsigned integer"),
        ({"checksum": 2**70}, "checksum must be a 64-bit unsigned integer"),
        ({"checksum": float("inf")}, "checksum must be an integer, not float"),
        ({"shape": "24"}, "shape must be a list of at most 8 sizes"),
        ({"shape": [1e400, 4]}, "shape must be an integer, not float"),
        ({"shape": [1] * 9}, "shape must be a list of at most 8 sizes"),
        ({"groups": 1e400}, "groups must be an integer, not float"),
        ({"dtype": 7}, "dtype must be a string"),
    ],
)
def test_malformed_headers_are_refused(change: dict[str, object], message: str) -> None:
    """Every field of its exact type (a peer's JSON: 1e400 parses as inf), with a short message."""
    raw = codec.encode(blocks(), Compression.INT8, GROUPS)[0].to_dict() | change
    with pytest.raises(codec.CodecError, match=message) as caught:
        codec.KVHeader.from_dict(raw)
    assert len(str(caught.value)) < 400


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


@contextlib.contextmanager
def kernel_set(name: str) -> Iterator[str]:
    """The named kernels in use for the block (yields the name of the set in use), then the default."""
    try:
        yield codec.use_kernels(name)
    finally:
        codec.use_kernels(os.environ.get("DLLM_KV_CODEC_KERNELS", "native"))


OTHER_KERNELS = [
    pytest.param("native"),
    pytest.param("compiled", marks=[pytest.mark.slow, pytest.mark.timeout(240)]),
]


@pytest.mark.parametrize("kernels", OTHER_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("compression", QUANTIZED)
def test_kernels_match_plain_ones_bit_for_bit(
    compression: Compression, dtype: torch.dtype, kernels: str
) -> None:
    """Every finite 16-bit value, and edge groups: the same payload and decoded values, to the bit."""
    kv = adversarial_blocks(dtype)
    with kernel_set("plain"):
        expected_header, expected = codec.encode(kv, compression, GROUPS)
        reference = codec.decode(expected_header, expected)
    with kernel_set(kernels) as in_use:
        if COMPILER is None:
            pytest.skip(f"no C compiler here: the {kernels} kernels are unavailable")
        assert in_use == kernels
        header, payload = codec.encode(kv, compression, GROUPS)
        restored = codec.decode(header, payload)
    assert header == expected_header
    assert torch.equal(payload, expected)
    assert torch.equal(codec.as_bytes(restored), codec.as_bytes(reference))


def compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", QUANTIZED)
def test_after_warm_up_no_transfer_compiles_a_kernel(compression: Compression) -> None:
    """A kernel compiled on a request's path stalled that send for seconds, past the receiver's
    timeout (seen with a one-block prompt): warm-up must leave nothing to compile for any batch."""
    shape = (12, 4, 16, 64)  # vLLM CPU: per KV head its K rows then its V rows
    caches = {name: torch.randn(shape).to(torch.bfloat16) for name in ("a", "b")}
    kv = PagedKV(caches, 12, Geometry(block_size=16, num_kv_heads=2, head_dim=32))
    torch._dynamo.reset()  # what other tests compiled must not hide a missing warm-up
    with kernel_set("compiled") as in_use:
        if COMPILER is None:
            pytest.skip("no C compiler here: torch.compile is unavailable")
        assert in_use == "compiled"
        codec.warm_up(kv.gather([0]), compression, kv.layout.groups)
        after_warm_up = compiled_graphs()
        for ids in ([3], [1, 4], [0, 5, 6, 7, 8]):
            batch = kv.batch_shape(len(ids))
            header, payload = codec.encode_parts(
                kv.gather_layers(ids), batch, kv.dtype, compression, kv.layout.groups
            )
            kv.scatter_layers(ids, codec.decode_parts(header, payload, kv.num_layers))
    assert after_warm_up > 0
    assert compiled_graphs() == after_warm_up


@pytest.mark.parametrize("compression", list(Compression))
def test_encode_leaves_the_kv_untouched(compression: Compression) -> None:
    kv = blocks(dtype=torch.float32)
    before = kv.clone()
    codec.encode(kv, compression, GROUPS)
    assert torch.equal(kv, before)


def native_fp8_decode() -> codec.DecodeFn:
    if COMPILER is None:
        pytest.skip("no C compiler here: the native kernels are unavailable")
    library = native_codec.load()
    assert library is not None
    return native_kernels(library)[Compression.FP8].decode_into


FP8_DECODES: dict[str, Callable[[], codec.DecodeFn]] = {
    "per code": lambda: quant.decoding_with(quant.fp8_values),
    "torch cast": lambda: quant.decoding_with(quant.fp8_values_cast),
    "by words": lambda: quant.fp8_decode_by_words(quant.fp8_half_words, quant.fp8_widen_into),
    "native": native_fp8_decode,
}


@pytest.mark.parametrize("make_decode", FP8_DECODES.values(), ids=FP8_DECODES.keys())
def test_fp8_decode_is_exact_for_every_finite_code(make_decode: Callable[[], codec.DecodeFn]) -> None:
    decode_into = make_decode()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    scale = torch.tensor([2.0**-126, 2.0**120])  # the smallest and largest scales encode writes
    want = codes.view(torch.float8_e4m3fn).float() * scale.unsqueeze(1)
    finite = torch.isfinite(want)
    got = torch.empty(codes.shape)
    decode_into(codes, scale, float(torch.finfo(torch.float32).max), got)
    assert torch.equal(got[finite], want[finite])


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
