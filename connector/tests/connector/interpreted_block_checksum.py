"""codec.block_checksum's kernel in Triton's interpreter (run by test_kv_block_checksum.py with
TRITON_INTERPRET=1; skipped without it): the value the gather gives, on every layout and head range,
after bytes that end at a row's start, inside a row or just before a row ends."""

from __future__ import annotations

import os

import pytest
import torch
from block_cases import BLOCKS, HEAD_RANGES, gathered_value, layout_kv

from dllm_connector.codec.device_checksum import ROW_WORDS, RunningTensorChecksum, blocks_in_place
from dllm_connector.pipe.span_checksum import DeviceChunkChecksum

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
]


@pytest.mark.parametrize("layout", ["nhd", "hnd", "mla"])
@pytest.mark.parametrize("heads", HEAD_RANGES)
@pytest.mark.parametrize("prefix_words", [0, 3, ROW_WORDS - 700])
def test_the_kernel_gives_the_gathers_value(
    layout: str, heads: tuple[int, int] | None, prefix_words: int
) -> None:
    """Just before a row ends, the blocks run into the next row, a tile split between the two."""
    if layout == "mla" and heads is not None:
        pytest.skip("MLA has one latent per token: no head range")
    kv = layout_kv(layout)
    prefix = torch.arange(prefix_words * 8, dtype=torch.int64).to(torch.uint8)
    words = kv.block_words(heads)
    assert words is not None
    running = RunningTensorChecksum()
    running.add(prefix)
    ids = torch.tensor(BLOCKS)
    for layer in words:
        running.add_blocks(layer, ids)
    assert running.value == gathered_value(kv, heads, prefix)


def test_a_changed_block_a_swapped_pair_and_one_block_fewer_each_change_the_value() -> None:
    kv = layout_kv("nhd")
    words = kv.block_words(None)
    assert words is not None

    def value(blocks: list[int]) -> int:
        running = RunningTensorChecksum()
        for layer in words:
            running.add_blocks(layer, torch.tensor(blocks))
        return running.value

    original = value(BLOCKS)
    assert value([BLOCKS[1], BLOCKS[0], *BLOCKS[2:]]) != original
    assert value(BLOCKS[:-1]) != original
    kv.caches[1][1, BLOCKS[2], 3, 1, 7] += 1.0
    assert value(BLOCKS) != original


def test_the_zero_copy_checksum_reads_in_place_where_the_kernel_serves_and_gets_the_same_value() -> None:
    """DeviceChunkChecksum, a layer at a time as the pipe adds them, of a head range."""
    kv = layout_kv("nhd")
    assert blocks_in_place(torch.device("cpu"))
    in_place = DeviceChunkChecksum(kv, BLOCKS, (0, 2))
    assert in_place._words is not None
    for layer in range(kv.num_layers):
        in_place.add_layers(range(layer, layer + 1))
    assert in_place.value == gathered_value(kv, (0, 2), torch.empty(0, dtype=torch.uint8))


@pytest.mark.parametrize("run_words", [40, 4101])
def test_runs_short_and_long_after_bytes_ending_mid_row(run_words: int) -> None:
    """The kernel's two variants (64-word tiles, 1024-word tiles over runs of several tiles and a
    partial one), on blocks that start 333 words before a row ends."""
    generator = torch.Generator().manual_seed(run_words)
    cache = torch.randint(-(2**62), 2**62, (16, 2, 3, run_words), generator=generator, dtype=torch.int64)
    ids = torch.randperm(16, generator=generator)[:10]
    prefix = torch.arange((ROW_WORDS - 333) * 8, dtype=torch.int64).to(torch.uint8)
    in_place, gathered = RunningTensorChecksum(), RunningTensorChecksum()
    for running in (in_place, gathered):
        running.add(prefix)
    in_place.add_blocks(cache, ids)
    gathered.add(cache.index_select(0, ids).view(-1).view(torch.uint8))
    assert in_place.value == gathered.value
