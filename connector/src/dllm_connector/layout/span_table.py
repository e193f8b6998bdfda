"""A zero-copy chunk's block spans as arrays: every (layer, block, segment, run) address in int64 tensors
on the host, and the merge of neighbours contiguous on both sides, with no Python object per span
(gpu-review item 14).

A long prompt's zero-copy transfer writes one span per layer, block and segment (hundreds of thousands
per rank for a long prompt of a large model): listed as tuples, merged in a Python loop and wrapped in
one object each, they cost the sending thread many times what the spans take on an RDMA link
(docs/benchmarks.md). Here each step is a few tensor ops over all of them; the one-sided transport
takes the columns as lists (transport.base.SpanList).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dllm_connector.layout.block_addresses import BlockAddresses


@dataclass(frozen=True)
class SpanTable:
    """`addrs[layer, i]`: the address of span i of a layer, in gather order (block, segment, run);
    `lengths[i]`: its length, the same in every layer."""

    addrs: torch.Tensor  # int64 [layers, spans per layer]
    lengths: torch.Tensor  # int64 [spans per layer]

    @property
    def layer_bytes(self) -> int:
        return int(self.lengths.sum())

    def matches(self, other: SpanTable) -> bool:
        """As many layers and spans as `other`, of the same lengths in the same order."""
        return self.addrs.shape == other.addrs.shape and torch.equal(self.lengths, other.lengths)


def span_table(addresses: BlockAddresses, block_ids: Sequence[int]) -> SpanTable:
    """The spans `addresses.spans(block_ids)` lists, as a table."""
    strides = [(layer.base, layer.block_stride, layer.segment_stride) for layer in addresses.layers]
    layers = torch.tensor(strides, dtype=torch.int64).view(-1, 3, 1, 1, 1)
    base, block_stride, segment_stride = layers[:, 0], layers[:, 1], layers[:, 2]  # each [layers, 1, 1, 1]
    blocks = torch.tensor(list(block_ids), dtype=torch.int64).view(1, -1, 1, 1)
    segments = torch.arange(addresses.segments, dtype=torch.int64).view(1, 1, -1, 1)
    offsets = torch.tensor([offset for offset, _ in addresses.runs], dtype=torch.int64).view(1, 1, 1, -1)
    lengths = torch.tensor([length for _, length in addresses.runs], dtype=torch.int64)
    addrs = base + blocks * block_stride + segments * segment_stride + offsets
    per_layer = lengths.expand(len(block_ids), addresses.segments, -1).reshape(-1)
    return SpanTable(addrs.reshape(len(addresses.layers), -1), per_layer)


def merged(
    src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Span pairs (1-D addresses on each side, their lengths) with neighbours that are contiguous on
    both sides merged into one: (source addresses, destination addresses, lengths) of the runs."""
    if src.numel() == 0:
        return src, dst, lengths
    joins = (src[:-1] + lengths[:-1] == src[1:]) & (dst[:-1] + lengths[:-1] == dst[1:])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(~joins).view(-1) + 1])
    ends = torch.cumsum(lengths, 0)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), ends])[starts]  # bytes before each run
    after = torch.cat([before[1:], ends[-1:]])
    return src[starts], dst[starts], after - before
