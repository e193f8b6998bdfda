"""Decode names where a zero-copy part goes as arithmetic (gpu-review item 5): the accept for a long
prompt on a large model stays small where a list of its spans passed the side channel's message cap,
and prefill works out exactly the spans decode's own cache lists, on each layout and head range."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dllm_connector.layout import BlockAddresses, Geometry, LayerAddress, PagedKV
from dllm_connector.pipe.messages import Accept, Destination
from dllm_connector.transport.sidechannel.framing import MAX_MESSAGE_BYTES

BLOCKS, TOKENS, HEADS, HEAD_DIM = 12, 6, 4, 8


def cache(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(3)}


LAYOUTS = {
    "cpu [N, H, T, 2D]": cache((BLOCKS, HEADS, TOKENS, 2 * HEAD_DIM)),
    "gpu [2, N, T, H, D]": cache((2, BLOCKS, TOKENS, HEADS, HEAD_DIM)),
    "gpu [N, 2, T, H, D]": cache((BLOCKS, 2, TOKENS, HEADS, HEAD_DIM)),
}


@pytest.mark.parametrize("heads", [None, (1, 3)], ids=["all heads", "heads 1-2"])
@pytest.mark.parametrize("caches", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_spans_worked_out_from_the_accept_are_the_caches_own(
    caches: dict[str, torch.Tensor], heads: tuple[int, int] | None
) -> None:
    kv = PagedKV(caches, BLOCKS, Geometry(block_size=TOKENS, num_kv_heads=HEADS, head_dim=HEAD_DIM))
    where = kv.addresses(heads)
    named = Destination(
        layers=[(a.base, a.block_stride, a.segment_stride) for a in where.layers],
        segments=where.segments,
        runs=list(where.runs),
        blocks=[7, 2, 9],
    )
    sent = Accept.model_validate_json(Accept(type="accept", skip=0, count=3, dst=named).model_dump_json()).dst
    assert sent is not None
    layers = tuple(LayerAddress(*layer) for layer in sent.layers)
    worked_out = BlockAddresses(layers, sent.segments, tuple(sent.runs)).spans(sent.blocks)
    assert worked_out == kv.spans([7, 2, 9], heads)
    # each span lies inside the cache it names, as many as gather order lists
    for tensor in kv.caches:
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        assert any(start <= addr and addr + n <= end for addr, n in worked_out)
    assert len(worked_out) == where.spans_per_block * 3


def test_a_128k_token_accept_on_a_70b_cache_is_small_where_its_spans_passed_the_message_cap() -> None:
    """Llama-70B at TP 4: 80 layers, K and V apart, 16-token blocks, one rank's 2 heads of 128 in
    bf16 per segment. The accept for 128k tokens names 8,192 blocks: under 100 KB of JSON, where the
    span list it replaced (2 x 80 spans a block, ~23 bytes each) was over the side channel's cap."""
    segment_bytes = 16 * 2 * 128 * 2
    block_stride = 2 * segment_bytes
    layers = [(0x7F00_0000_0000 + i * (1 << 32), block_stride, segment_bytes) for i in range(80)]
    blocks = list(range(100_000, 100_000 + 8192))
    named = Destination(layers=layers, segments=2, runs=[(0, segment_bytes)], blocks=blocks)
    accept = Accept(type="accept", skip=0, count=len(blocks), dst=named).model_dump_json()
    assert len(accept) < 100_000
    listed = BlockAddresses(tuple(LayerAddress(*layer) for layer in layers), 2, ((0, segment_bytes),)).spans(
        blocks
    )
    assert len(listed) == 80 * 2 * 8192
    assert len(str(listed).replace(" ", "")) > MAX_MESSAGE_BYTES


def test_a_destination_beyond_its_bounds_is_refused_before_use() -> None:
    """A peer's accept: no layer, more than two segments, a negative address or a run list of
    100k entries never reaches the arithmetic."""
    good: dict[str, Any] = {"layers": [(1, 2, 3)], "segments": 2, "runs": [(0, 8)], "blocks": [1]}
    refused: list[dict[str, Any]] = [
        {"layers": []},
        {"segments": 3},
        {"layers": [(-1, 2, 3)]},
        {"runs": [(0, 8)] * 100_000},
        {"blocks": [1 << 30]},
    ]
    for bad in refused:
        with pytest.raises(ValueError, match="validation error"):
            Destination.model_validate(good | bad)
