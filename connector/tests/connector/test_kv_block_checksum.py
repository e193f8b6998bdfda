"""The zero-copy checksum reading blocks where they lie (gpu-review item 14): layout.block_words names
each layout's blocks as strided runs of words; codec.block_checksum's Triton kernel gives the value the
gather gives. The kernel's cases (interpreted_block_checksum.py) run in Triton's interpreter, which
must be on before Triton is first imported, so in a process of their own; a GPU runs the kernel
compiled (test_kv_data_path_cuda.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from block_cases import BLOCKS, HEAD_RANGES, NUM_BLOCKS, layout_kv

from dllm_connector.codec.device_checksum import RunningTensorChecksum, blocks_in_place
from dllm_connector.layout.block_words import block_words
from dllm_connector.pipe.span_checksum import DeviceChunkChecksum

pytestmark = pytest.mark.timeout(120)

INTERPRETED = Path(__file__).with_name("interpreted_block_checksum.py")


@pytest.mark.parametrize("layout", ["nhd", "hnd", "cpu", "mla"])
@pytest.mark.parametrize("heads", HEAD_RANGES)
def test_each_layouts_blocks_as_words_hold_the_gathered_bytes(
    layout: str, heads: tuple[int, int] | None
) -> None:
    if layout == "mla" and heads is not None:
        pytest.skip("MLA has one latent per token: no head range")
    kv = layout_kv(layout)
    words = kv.block_words(heads)
    assert words is not None
    for layer in words:
        assert (layer.dtype, layer.dim(), layer.stride(3), layer.shape[0]) == (torch.int64, 4, 1, NUM_BLOCKS)
    ids = torch.tensor(BLOCKS)
    gathered = kv.gathered_bytes(BLOCKS, heads, range(kv.num_layers), 1 << 30)
    expected = torch.cat([run.clone() for run in gathered])  # each run reuses one buffer
    got = torch.cat([layer.index_select(0, ids).reshape(-1) for layer in words])
    assert torch.equal(got.view(torch.uint8), expected)


def test_blocks_that_are_not_whole_aligned_words_have_no_word_view() -> None:
    """A run of 3 bf16 values (6 bytes), and a view that starts 2 bytes into its memory: the gather
    serves those."""
    assert block_words(torch.zeros(4, 2, 3, dtype=torch.bfloat16)) is None
    assert block_words(torch.zeros(4 * 8 + 1, dtype=torch.bfloat16)[1:].view(4, 8)) is None
    assert block_words(torch.zeros(4, 8, dtype=torch.bfloat16)) is not None


def test_outside_the_interpreter_the_cpu_gathers() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"
    assert not blocks_in_place(torch.device("cpu"))
    assert DeviceChunkChecksum(layout_kv("nhd"), BLOCKS, None)._words is None


def test_blocks_after_bytes_that_end_mid_word_are_refused() -> None:
    running = RunningTensorChecksum()
    running.add(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole words"):
        running.add_blocks(torch.zeros(2, 1, 1, 4, dtype=torch.int64), torch.tensor([0]))


@pytest.mark.timeout(300)
def test_the_kernel_gives_the_gathers_value_in_tritons_interpreter() -> None:
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "19 passed" in done.stdout, done.stdout[-2000:]
