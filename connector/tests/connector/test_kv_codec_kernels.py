"""The codec's kernel sets (native C, torch.compile) against the plain torch ops, bit for bit, on
adversarial values; no kernel compiled after warm-up; every fp8 decode exact for every finite code."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator

import pytest
import torch
from codec_cases import GROUPS, QUANTIZED, adversarial_blocks

from dllm_connector import codec
from dllm_connector.codec import native as native_codec
from dllm_connector.codec import quant
from dllm_connector.codec.native_kernels import native_kernels
from dllm_connector.layout import Geometry, PagedKV
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

COMPILER = shutil.which("cc") or shutil.which("gcc")


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
