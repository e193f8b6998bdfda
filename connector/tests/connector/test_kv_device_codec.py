"""The device path of the KV codec (issue 20), run here with the CPU as the device: the nh64
checksum against a pure-Python reference, the header naming its checksum's algorithm, the torch
kernels against the C ones bit for bit, and the device path's deferred checks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_connector import codec
from dllm_connector.codec import device_checksum, kernel_sets
from dllm_connector.codec.checksum import combine_checksums
from dllm_connector.codec.stream import device_path
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[3]
NH64 = codec.ChecksumAlgo.NH64
XXH3 = codec.ChecksumAlgo.XXH3_64
M64 = (1 << 64) - 1


# ---- a pure-Python reference of device_checksum, from its docstring ---------------------------------


def _splitmix64(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def reference_checksum(data: bytes, row_words: int) -> int:
    padded = data + bytes(-len(data) % 8)
    products: dict[int, int] = {}
    words: dict[int, int] = {}
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        x = word ^ _splitmix64(0x9E3779B97F4A7C15 + i % row_words)
        row = i // row_words
        products[row] = (products.get(row, 0) + _signed32(x) * _signed32(x >> 32)) & M64
        words[row] = (words.get(row, 0) + word) & M64
    total = 0
    for row in range(-(-len(data) // (8 * row_words))):
        total += device_checksum.fmix64(products.get(row, 0) + (row + 1) * 0x9E3779B97F4A7C15)
        total += device_checksum.fmix64(words.get(row, 0) + (row + 1) * 0x8CB92BA72F3D8DD7)
    return device_checksum.fmix64(total + device_checksum.fmix64(len(data) + 0xD6E8FEB86659FD93))


@pytest.fixture
def small_rows(monkeypatch: pytest.MonkeyPatch) -> int:
    """Rows of 4 words, so that the reference covers many rows in a few hundred bytes."""
    monkeypatch.setattr(device_checksum, "ROW_WORDS", 4)
    monkeypatch.setattr(device_checksum, "_keys_by_device", {})
    return 4


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def extreme_bytes(count: int, seed: int) -> bytes:
    """Random bytes with runs of 0xff and 0x80 (words near the int64 limits: every product and sum
    wraps) and zeros."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < count:
        kind, run = rng.choice([None, 0xFF, 0x80, 0]), rng.randint(1, 24)
        out += bytes(rng.getrandbits(8) if kind is None else kind for _ in range(run))
    return bytes(out[:count])


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 31, 32, 33, 64, 200, 257])
def test_the_checksum_equals_the_pure_python_reference_wrapping_at_64_bits(
    small_rows: int, length: int
) -> None:
    for seed in range(3):
        data = extreme_bytes(length, seed)
        assert device_checksum.tensor_checksum(as_tensor(data)) == reference_checksum(data, small_rows)


def test_the_reference_holds_with_the_real_row_size_over_several_rows() -> None:
    data = extreme_bytes(2 * device_checksum.ROW_WORDS * 8 + 4099, 7)
    assert device_checksum.tensor_checksum(as_tensor(data)) == reference_checksum(
        data, device_checksum.ROW_WORDS
    )


def test_any_split_gives_the_value_of_the_whole(small_rows: int) -> None:
    rng = random.Random(3)
    data = as_tensor(extreme_bytes(301, 1))
    whole = device_checksum.tensor_checksum(data)
    for _ in range(60):
        cuts = sorted(rng.randint(0, data.numel()) for _ in range(rng.randint(0, 6)))
        running = device_checksum.RunningTensorChecksum()
        for start, stop in zip([0, *cuts], [*cuts, data.numel()], strict=True):
            running.add(data[start:stop])  # empty, one-byte and misaligned pieces among them
        assert running.nbytes == data.numel()
        assert running.value == whole


def test_pieces_straddling_real_rows_and_misaligned_views_agree() -> None:
    words = device_checksum.ROW_WORDS
    data = torch.randint(
        0, 256, (3 * words * 8 + 13,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    whole = device_checksum.tensor_checksum(data)
    running = device_checksum.RunningTensorChecksum()
    for start, stop in [
        (0, 5),
        (5, words * 8 + 3),
        (words * 8 + 3, 2 * words * 8 + 16),
        (2 * words * 8 + 16, data.numel()),
    ]:
        running.add(data[start:stop])
    assert running.value == whole
    # A view at an odd offset hashes as its bytes do anywhere else.
    assert device_checksum.tensor_checksum(data[3:]) == device_checksum.tensor_checksum(data[3:].clone())


def test_many_small_pieces_added_at_once_give_the_value_of_the_whole(small_rows: int) -> None:
    """add_all gathers small pieces (a cache's block spans) into runs: the same value as one by one."""
    rng = random.Random(5)
    data = as_tensor(extreme_bytes(700, 2))
    cuts = sorted(rng.sample(range(1, data.numel()), 40))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, data.numel()], strict=True)]
    whole = device_checksum.tensor_checksum(data)
    for gather_bytes in (1, 16, 100, 1 << 20):
        running = device_checksum.RunningTensorChecksum()
        running.add(data[:0])
        running.add_all(pieces[:20], gather_bytes=gather_bytes)
        running.add_all(pieces[20:], gather_bytes=gather_bytes)
        assert running.value == whole
    mixed = device_checksum.RunningTensorChecksum()
    with pytest.raises(ValueError, match="one device only"):
        mixed.add_all([data[:8], torch.ones(8, dtype=torch.uint8, device="meta")])
    assert mixed.nbytes == 0


def test_values_reads_several_checksums_at_once_as_each_alone() -> None:
    pieces = [as_tensor(extreme_bytes(n, n)) for n in (0, 5, 4096)]
    running = []
    for piece in pieces:
        one = device_checksum.RunningTensorChecksum()
        one.add(piece)
        running.append(one)
    assert device_checksum.values(running) == [device_checksum.tensor_checksum(p) for p in pieces]


def test_corruptions_a_transfer_can_suffer_change_the_value() -> None:
    words = device_checksum.ROW_WORDS
    data = torch.randint(
        0, 256, (4 * words * 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    value = device_checksum.tensor_checksum(data)
    seen = {value}

    def changed(corrupt: torch.Tensor) -> None:
        other = device_checksum.tensor_checksum(corrupt)
        assert other not in seen
        seen.add(other)

    for byte, bit in [(0, 0), (7, 7), (12345, 3), (data.numel() - 1, 7)]:
        flipped = data.clone()
        flipped[byte] ^= 1 << bit
        changed(flipped)
    # The top bit of two words: a plain wrapping sum of words would cancel these.
    both = data.clone()
    both[7] ^= 0x80
    both[8 * 1000 + 7] ^= 0x80
    changed(both)
    # Two words swapped within a row, and two whole rows swapped (a piece written to the wrong slot).
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16], data[:8]
    changed(swapped)
    rows = data.clone().view(4, -1)
    rows[[0, 2]] = rows[[2, 0]]
    changed(rows.view(-1))
    # A piece left zeroed, and a trailing zero byte.
    zeroed = data.clone()
    zeroed[words * 8 : words * 8 + 4096] = 0
    changed(zeroed)
    changed(torch.cat([data, torch.zeros(1, dtype=torch.uint8)]))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.zeros(4, dtype=torch.int32), "contiguous 1-D uint8"),
        (torch.zeros(2, 8, dtype=torch.uint8), "contiguous 1-D uint8"),
        (torch.zeros(16, dtype=torch.uint8)[::2], "contiguous 1-D uint8"),
    ],
)
def test_data_that_is_not_a_byte_vector_is_refused(bad: torch.Tensor, message: str) -> None:
    running = device_checksum.RunningTensorChecksum()
    with pytest.raises(ValueError, match=message):
        running.add(bad)
    assert running.nbytes == 0


def test_pieces_on_two_devices_are_refused_before_either_is_mixed() -> None:
    running = device_checksum.RunningTensorChecksum()
    running.add(torch.ones(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="one device only"):
        running.add(torch.ones(8, dtype=torch.uint8, device="meta"))
    assert running.value == device_checksum.tensor_checksum(torch.ones(8, dtype=torch.uint8))


def test_an_unknown_kernel_name_is_refused() -> None:
    with pytest.raises(ValueError, match="none of auto, eager, compiled"):
        device_checksum.use_kernel("fast")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_compiled_checksum_gives_the_eager_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_checksum, "_compiled", {})
    data = torch.randint(0, 256, (3 * device_checksum.ROW_WORDS * 8 + 11,), dtype=torch.uint8)
    eager = device_checksum.tensor_checksum(data)
    device_checksum.use_kernel("compiled")
    try:
        assert device_checksum.kernel(data.device) is not device_checksum.terms_sum
        assert device_checksum.tensor_checksum(data) == eager
    finally:
        device_checksum.use_kernel("auto")


# ---- the header names its checksum's algorithm ---------------------------------------------------


GROUPS = 4


def blocks(num_blocks: int = 6, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, GROUPS, 16, 8, generator=generator).to(dtype)


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


# ---- the device path, on the CPU as the device ------------------------------------------------------


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


@pytest.mark.parametrize("compression", [Compression.FP8, Compression.INT8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_torch_kernels_write_the_c_kernels_bytes_on_a_realistic_kv(
    compression: Compression, dtype: torch.dtype
) -> None:
    """Two layers of 8 KV heads, head_dim 128, block size 16, with subnormal, zero, huge and
    power-of-two groups among random ones: codes, scales and decoded values, bit for bit."""
    generator = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 3, 2 * 8, 16, 128, generator=generator) * 4
    info = torch.finfo(dtype)
    kv[0, 0, 0] = 0.0
    kv[0, 0, 1] *= info.tiny
    kv[0, 1, 2] = info.max * torch.linspace(-1, 1, 16 * 128).view(16, 128)
    kv[1, 2, 3] = 2.0 ** torch.arange(-8, 8).float().repeat(128).view(16, 128)
    kv = kv.to(dtype)
    groups = 2 * 8 * 3
    shape = tuple(kv.shape)
    codec.use_kernels("native")
    host_header, host_payload = codec.encode_parts(kv.chunk(kv.shape[0]), shape, dtype, compression, groups)
    host_values = codec.decode(host_header, host_payload)
    codec.use_kernels("plain")
    try:
        header, payload = codec.encode_parts(
            kv.chunk(kv.shape[0]), shape, dtype, compression, groups, checksum_algo=NH64
        )
        values = codec.decode(header, payload)
    finally:
        codec.use_kernels("native")
    assert torch.equal(payload, host_payload)
    assert torch.equal(values.view(torch.uint8), host_values.view(torch.uint8))


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


@pytest.mark.parametrize("compression", list(Compression))
def test_warm_up_for_device_staging_checks_the_kernels_there(compression: Compression) -> None:
    codec.warm_up(blocks(), compression, GROUPS, staging=torch.device("cpu"))


def test_kernels_that_write_other_bytes_where_staging_is_are_refused_at_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fake_off_by_one: a kernel set whose int8 codes differ from the host's (no real set does on a
    CPU; a GPU compiler's division could), refused before any payload is written with it."""
    plain = kernel_sets._PLAIN

    def fake_off_by_one(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        plain[Compression.INT8].encode_into(rows, codes, scales)
        codes.add_(1)

    int8 = kernel_sets._CodecKernels(fake_off_by_one, plain[Compression.INT8].decode_into)
    fake = kernel_sets._Kernels(
        {Compression.FP8: plain[Compression.FP8], Compression.INT8: int8}, "fake", 1 << 18
    )
    monkeypatch.setattr(kernel_sets, "_kernels", fake)
    codec.warm_up(blocks(), Compression.FP8, GROUPS, staging=torch.device("cpu"))
    with pytest.raises(
        codec.CodecError, match="fake int8 KV kernels on cpu write other bytes than the host's"
    ):
        codec.warm_up(blocks(), Compression.INT8, GROUPS, staging=torch.device("cpu"))


# ---- the GPU check, run here on the CPU ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_gpu_check_runs_on_the_cpu_and_finds_the_kernels_equal(tmp_path: Path) -> None:
    """bench/gpu_check.py --device cpu --quick: the same code paths as on a GPU, small sizes."""
    written = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick"]
    done = subprocess.run(
        [*command, "--json", str(written)], capture_output=True, text=True, timeout=360, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report == json.loads(written.read_text())
    assert report["all_equal"] is True
    assert {"device", "torch", "triton", "goal_gbps", "sizes", "mooncake", "seconds"} <= report.keys()
    (size,) = report["sizes"]
    assert size["tokens"] == 256
    assert {row["codec"] for row in size["codec"]} == {"fp8", "int8"}
    for row in size["codec"]:
        for key in ("encode_layers_gbps", "encode_whole_gbps", "decode_layers_gbps", "decode_whole_gbps"):
            assert row[key] > 0
    assert [row["kernel"] for row in size["checksum"]] == ["eager"]
    assert len(size["equality"]) == 2
    for row in size["equality"]:
        assert row["payload_equal"] is row["decoded_equal"] is row["checksum_equal"] is True
        assert row["bytes"] > 0
    assert "skipped" in size["copies"]
    mooncake = report["mooncake"]
    assert mooncake.get("checksum_equal") is True or "skipped" in mooncake, mooncake
    assert "all equal: True" in done.stderr  # the human table


@pytest.mark.parametrize("kernels", ["native", "plain"])
def test_forged_nan_codes_never_decode_to_nan(kernels: str) -> None:
    """L3 for codes: encode never writes e4m3's two NaN codes, a peer can (with a right checksum);
    every kernel set decodes them to finite values (the C kernels +-480 x scale, torch ops +-448)."""
    header, payload = codec.encode(blocks(), Compression.FP8, GROUPS)
    forged = payload.clone()
    forged[:4] = torch.tensor([0x7F, 0xFF, 0x7F, 0xFF], dtype=torch.uint8)
    forged_header = codec.KVHeader(header.codec, header.dtype, header.shape, header.groups, 0)
    forged_header = codec.KVHeader(
        header.codec, header.dtype, header.shape, header.groups, codec.checksum(forged_header, forged)
    )
    codec.use_kernels(kernels)
    try:
        values = codec.decode(forged_header, forged).float().view(-1)
    finally:
        codec.use_kernels("native")
    assert torch.isfinite(values).all()
    assert (values[:4].sign() == torch.tensor([1.0, -1.0, 1.0, -1.0])).all()


@pytest.mark.parametrize("hi_of_x", [1, -1])
def test_a_flip_in_a_word_whose_mixed_high_half_is_one_changes_the_checksum(hi_of_x: int) -> None:
    """Where hi(w ^ k) is +-1, a flip of the word's low bits moves lo(w ^ k) * hi(w ^ k) by exactly
    minus what it moves the word: one sum of both would not see it (review of issue 20, finding 6).
    The words' own sum, kept apart, does, for one bit and for every such bit at once."""
    key = int(device_checksum._keys(torch.device("cpu"))[0]) & M64
    key_lo, key_hi = key & 0xFFFFFFFF, key >> 32
    rng = random.Random(hi_of_x)
    tail = [rng.getrandbits(64) for _ in range(7)]
    if hi_of_x == 1:  # x's low bits where the key has a 1 go 1 -> 0 as the word's go 0 -> 1
        high, cancelling = key_hi ^ 1, key_lo & 0x7FFFFFFF
        word = (high << 32) | (rng.getrandbits(32) & ~key_lo & 0x7FFFFFFF)
    else:  # hi(x) = -1: the key's zero bits do the same with the opposite sign
        high, cancelling = ~key_hi & 0xFFFFFFFF, ~key_lo & 0x7FFFFFFF
        word = (high << 32) | (rng.getrandbits(32) & key_lo & 0x7FFFFFFF)

    def checksum(words: list[int]) -> int:
        signed = [w - (1 << 64) if w >> 63 else w for w in words]
        return device_checksum.tensor_checksum(torch.tensor(signed, dtype=torch.int64).view(torch.uint8))

    original = checksum([word, *tail])
    assert checksum([word ^ (cancelling & -cancelling), *tail]) != original
    assert checksum([word | cancelling, *tail]) != original
