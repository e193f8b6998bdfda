"""The device path's payloads and their checks, on the CPU as the device: an nh64 payload is hashed
region by region and carries the host's bytes, a stream verifies by the algorithm its sender named,
and corruption, forged scales and NaN are caught, the checks that would need a host sync per part
deferred to verify."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from codec_cases import GROUPS, NH64, XXH3, blocks

from dllm_connector import codec
from dllm_connector.codec import device_checksum
from dllm_connector.codec.checksum import combine_checksums
from dllm_connector.codec.stream import device_path
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


@pytest.fixture
def torch_kernels() -> Iterator[None]:
    """The kernels a device runs (plain torch ops) in place of the C ones, then the default back."""
    codec.use_kernels("plain")
    yield
    codec.use_kernels("native")


def encode_device_path(kv: torch.Tensor, compression: Compression) -> tuple[codec.KVHeader, torch.Tensor]:
    out = torch.empty(
        codec.payload_nbytes(compression, kv.dtype, tuple(kv.shape), GROUPS) + 64, dtype=torch.uint8
    )
    return codec.encode_parts(
        kv.chunk(3), tuple(kv.shape), kv.dtype, compression, GROUPS, out, checksum_algo=NH64
    )


@pytest.mark.parametrize("compression", list(Compression))
def test_an_nh64_payload_is_hashed_region_by_region_and_round_trips(compression: Compression) -> None:
    kv = blocks()
    header, payload = encode_device_path(kv, compression)
    assert device_path(header, payload)
    regions = [
        device_checksum.tensor_checksum(payload[start:stop]) for start, stop in header.ranges(0, kv.shape[0])
    ]
    expected = regions[0] if len(regions) == 1 else combine_checksums(*regions)
    assert header.checksum == expected == codec.checksum(header, payload)
    host_header, host_payload = codec.encode(kv, compression, GROUPS)
    assert torch.equal(payload, host_payload)  # one format on the wire: only the checksum differs
    assert header.same_layout(host_header)
    assert torch.equal(codec.decode(header, payload), codec.decode(host_header, host_payload))


def test_a_stream_verifies_by_the_algorithm_the_sender_named(torch_kernels: None) -> None:
    kv = blocks()
    header, payload = encode_device_path(kv, Compression.FP8)
    stream = codec.StreamingDecode(header, payload, 3)
    parts = [part.clone() for part in stream.parts_until(3)]
    stream.verify(header.checksum, header.checksum_algo)
    assert torch.equal(torch.cat(parts), codec.decode(header, payload))
    # Hashed with nh64 while decoding, told the sender's was XXH3: the payload is hashed again by it.
    xxh3 = codec.checksum(
        codec.KVHeader(header.codec, header.dtype, header.shape, header.groups, 0),
        payload[: header.payload_nbytes],
    )
    again = codec.StreamingDecode(header, payload, 3)
    for _ in again.parts_until(3):
        pass
    again.verify(xxh3, XXH3)
    with pytest.raises(codec.ChecksumError):
        again.verify(header.checksum, XXH3)


@pytest.mark.parametrize("where", ["data", "scales"])
def test_a_corrupted_nh64_payload_fails_its_stream_and_its_decode(where: str, torch_kernels: None) -> None:
    header, payload = encode_device_path(blocks(), Compression.INT8)
    payload[5 if where == "data" else header.data_nbytes + 2] ^= 0x04
    stream = codec.StreamingDecode(header, payload, 2)
    for _ in stream.parts_until(2):
        pass
    with pytest.raises(codec.ChecksumError):
        stream.verify(header.checksum, NH64)
    with pytest.raises(codec.ChecksumError):
        codec.decode(header, payload)


@pytest.mark.parametrize("compression", [Compression.FP8, Compression.INT8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_forged_scales_on_the_device_path_decode_as_zeros_and_fail_verify(
    compression: Compression, bad: float, torch_kernels: None
) -> None:
    """L3 without a host sync per part: the forger's checksum is right, yet no NaN, inf or
    negative scale reaches the cache, and the load fails at verify."""
    header, payload = encode_device_path(blocks(), compression)
    forged = payload.clone()
    forged[header.data_nbytes : header.payload_nbytes].view(torch.float32)[1] = bad
    forged_header = codec.KVHeader(header.codec, header.dtype, header.shape, header.groups, 0, NH64)
    forged_header = codec.KVHeader(
        header.codec, header.dtype, header.shape, header.groups, codec.checksum(forged_header, forged), NH64
    )
    stream = codec.StreamingDecode(forged_header, forged, 2)
    parts = [part.clone() for part in stream.parts_until(2)]
    decoded = torch.cat(parts).float().view(header.shape[0] * GROUPS, -1)
    assert torch.isfinite(decoded).all()
    assert (decoded[1] == 0).all()
    with pytest.raises(codec.CodecError, match="scales are not all finite, positive"):
        stream.verify(forged_header.checksum, NH64)
    with pytest.raises(codec.CodecError, match="scales are not all finite, positive"):
        next(codec.decode_parts(forged_header, forged, 2))


def test_nan_in_the_kv_is_refused_on_the_device_path_too(torch_kernels: None) -> None:
    kv = blocks()
    kv[2, 1, 3, 4] = float("nan")
    with pytest.raises(codec.NonFiniteKVError, match="1 of 24 scale groups"):
        encode_device_path(kv, Compression.FP8)
