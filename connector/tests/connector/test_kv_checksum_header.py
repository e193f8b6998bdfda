"""The KV header names its checksum's algorithm: an XXH3 header is written as version 2 always was,
an nh64 one is version 3 and says so, and a header whose checksum cannot be verified is refused."""

from __future__ import annotations

import pytest
import torch
from codec_cases import GROUPS, NH64, XXH3, blocks

from dllm_connector import codec
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def test_an_xxh3_header_is_written_exactly_as_before() -> None:
    header, _ = codec.encode(blocks(), Compression.INT8, GROUPS)
    assert header.checksum_algo is XXH3
    assert header.to_dict() == {
        "v": 2,
        "codec": "int8",
        "dtype": "bfloat16",
        "shape": [6, GROUPS, 16, 8],
        "groups": GROUPS,
        "checksum": header.checksum,
    }
    assert codec.KVHeader.from_dict(header.to_dict()) == header


def test_an_nh64_header_is_version_3_and_names_its_algorithm() -> None:
    header, _ = codec.encode_parts(
        [blocks()], (6, GROUPS, 16, 8), torch.bfloat16, Compression.FP8, GROUPS, checksum_algo=NH64
    )
    raw = header.to_dict()
    assert raw["v"] == 3
    assert raw["checksum_algo"] == "nh64"
    assert codec.KVHeader.from_dict(raw) == header
    # An older connector (which reads version 2 only) refuses it by its version, before using a byte.
    assert raw["v"] != 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"v": 3, "checksum_algo": "crc32"},
            "checksum algorithm 'crc32'; this connector knows xxh3_64, nh64",
        ),
        ({"v": 3, "checksum_algo": 7}, "checksum algorithm 7"),
        ({"v": 3, "checksum_algo": "x" * 5000}, "checksum algorithm 'xxxx"),
        ({"v": 3}, "a version 3 KV header must name its checksum_algo"),
        ({"v": 2, "checksum_algo": "nh64"}, "version 2 KV header names no checksum_algo"),
        ({"v": 4, "checksum_algo": "nh64"}, "header version 4, this connector reads 2 and 3"),
    ],
)
def test_a_header_whose_checksum_cannot_be_verified_is_refused(
    change: dict[str, object], message: str
) -> None:
    raw = codec.encode(blocks(), Compression.INT8, GROUPS)[0].to_dict() | change
    with pytest.raises(codec.CodecError, match=message) as caught:
        codec.KVHeader.from_dict(raw)
    assert len(str(caught.value)) < 200  # a peer's string is never echoed whole


def test_an_xxh3_checksum_of_a_payload_off_the_host_is_refused_not_read_from_a_device_address() -> None:
    header, payload = codec.encode(blocks(), Compression.INT8, GROUPS)
    elsewhere = torch.empty(payload.shape, dtype=torch.uint8, device="meta")
    with pytest.raises(codec.CodecError, match="XXH3-64 checksum reads host memory"):
        codec.checksum(header, elsewhere)


def test_the_default_algorithm_follows_the_payload() -> None:
    assert codec.default_checksum_algo(torch.empty(8, dtype=torch.uint8)) is XXH3
    assert codec.default_checksum_algo(torch.empty(8, dtype=torch.uint8, device="meta")) is NH64


def test_same_layout_ignores_the_checksum_and_its_algorithm() -> None:
    header, _ = codec.encode(blocks(), Compression.FP8, GROUPS)
    other = codec.KVHeader(header.codec, header.dtype, header.shape, header.groups, 0, NH64)
    assert header.same_layout(other)
    assert not header.same_layout(codec.KVHeader(header.codec, header.dtype, (5, GROUPS, 16, 8), GROUPS, 0))
