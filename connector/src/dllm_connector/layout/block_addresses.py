"""Where a worker's KV blocks lie, as arithmetic instead of a list: per layer a base address and the
block and segment strides, and the runs inside one segment that hold the heads that travel. Pure: no
torch.

Decode tells prefill this in its accept, with the ids of the blocks it reserved, and prefill works out
the spans to write from them. A list of every (layer, block, segment) span is O(layers x blocks): for
a long prompt it outgrew the side channel's 16 MiB message cap (Llama-70B at TP 4 past about 73k
tokens) and took about a second of the GIL to build, encode, parse and validate (gpu-review item 5);
this is O(layers + blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerAddress:
    """One layer's cache: its first byte, and the bytes from one block (and one segment) to the next."""

    base: int
    block_stride: int
    segment_stride: int


@dataclass(frozen=True)
class BlockAddresses:
    """Every layer's addresses, the segments per block (K and V apart, or one), and the (offset,
    length) runs inside one segment that `spans` lists for each."""

    layers: tuple[LayerAddress, ...]
    segments: int
    runs: tuple[tuple[int, int], ...]

    @property
    def spans_per_block(self) -> int:
        return len(self.layers) * self.segments * len(self.runs)

    def spans(self, block_ids: Sequence[int], layers: range | None = None) -> list[tuple[int, int]]:
        """(address, bytes) of every (layer, block, segment, run), in that order (of `layers` only,
        where given)."""
        chosen = self.layers if layers is None else self.layers[layers.start : layers.stop]
        spans: list[tuple[int, int]] = []
        single = self.runs[0] if len(self.runs) == 1 else None
        for layer in chosen:
            for block in block_ids:
                start = layer.base + block * layer.block_stride
                if single is not None:  # whole segments, or one run per segment: the common case
                    offset, length = single
                    spans.extend(
                        (start + s * layer.segment_stride + offset, length) for s in range(self.segments)
                    )
                    continue
                for s in range(self.segments):
                    segment = start + s * layer.segment_stride
                    spans.extend((segment + offset, length) for offset, length in self.runs)
        return spans
