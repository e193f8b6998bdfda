"""KV headers and checksums (header version 2): the XXH3 checksum pinned to the wire format, a
corrupted or short payload refused, and a header that round trips, predicts its payload's size and
refuses every malformed field."""

from __future__ import annotations

import struct

import pytest
import xxhash
from codec_cases import GROUPS, blocks

from dllm_connector import codec
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]


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
