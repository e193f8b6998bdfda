"""KV codec round trips: bounded error for every codec and dtype, whole or in parts (decoded as the
parts arrive and verified after the last), into staging buffers, and the inputs encode and decode
refuse."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from codec_cases import GROUPS, QUANTIZED, blocks, error_bound

from dllm_connector import codec
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]


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


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("compression", list(Compression))
def test_fp8_kv_cache_passes_through_unchanged(kv_dtype: torch.dtype, compression: Compression) -> None:
    kv = blocks().to(kv_dtype)
    header, payload = codec.encode(kv, compression, GROUPS)
    assert header.codec is Compression.NONE
    assert payload.numel() == kv.numel()
    assert torch.equal(codec.as_bytes(codec.decode(header, payload)), codec.as_bytes(kv))


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


@pytest.mark.parametrize("compression", list(Compression))
def test_encode_leaves_the_kv_untouched(compression: Compression) -> None:
    kv = blocks(dtype=torch.float32)
    before = kv.clone()
    codec.encode(kv, compression, GROUPS)
    assert torch.equal(kv, before)
