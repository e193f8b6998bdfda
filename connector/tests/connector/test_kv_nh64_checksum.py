"""nh64, the device path's checksum: equal to a pure-Python reference of its docstring (wrapping
at 64 bits), the same value however a payload is split, changed by the corruptions a transfer can
suffer, and refusing what it cannot hash."""

from __future__ import annotations

import random

import pytest
import torch

from dllm_connector.codec import device_checksum

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

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
