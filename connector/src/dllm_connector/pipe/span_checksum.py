"""The zero-copy checksum: a chunk's blocks, layer by layer in gather order, where the cache is.

A zero-copy chunk's value is that of the codec-none payload its blocks would gather into (the same
bytes in the same order), under the algorithm of the side's data path:

- host path: XXH3-64 over the blocks' spans read in place by host cores (checksum.RunningChecksum);
- device path: nh64 (device_checksum.RunningTensorChecksum) over the blocks where they lie, one
  kernel launch per layer taking the block ids (codec.block_checksum, on a GPU); where that kernel
  does not serve, over the blocks gathered a layer at a time into a bounded buffer on the cache's
  device. Either way a few launches per layer, where hashing spans one by one costs a dozen launches
  per span (about 330k spans per rank for a 32k-token Llama-70B transfer); no block crosses to the
  host to be checked.

Each side picks the algorithm from its own data path and the header names it, so a peer on the
other path is refused by name. The sender hashes its source blocks before writing them, the
receiver its own blocks once the last write landed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from dllm_connector.codec import ChecksumAlgo
from dllm_connector.codec.checksum import RunningChecksum
from dllm_connector.codec.device_checksum import GATHER_BYTES, RunningTensorChecksum, blocks_in_place
from dllm_connector.layout import HeadRange, PagedKV, coalesce_runs
from dllm_connector.transport.base import SpanList


class ChunkChecksum(Protocol):
    def add_layers(self, layers: range, spans: SpanList | None = None) -> None:
        """The chunk's blocks in `layers`, after those added before. `spans`: their bytes as runs in
        order, where the caller has them (the sender's writes)."""

    @property
    def value(self) -> int: ...


class HostChunkChecksum:
    """XXH3-64 over the spans in place."""

    def __init__(self, kv: PagedKV, blocks: Sequence[int], heads: HeadRange | None) -> None:
        self._kv, self._blocks, self._heads = kv, blocks, heads
        self._running = RunningChecksum()

    def add_layers(self, layers: range, spans: SpanList | None = None) -> None:
        runs: Iterable[tuple[int, int]]
        if spans is None:
            runs = coalesce_runs(self._kv.spans(self._blocks, self._heads, layers))
        else:
            runs = zip(spans.addrs, spans.lengths, strict=True)
        for addr, nbytes in runs:
            self._running.add(addr, nbytes)

    @property
    def value(self) -> int:
        return self._running.value


class DeviceChunkChecksum:
    """nh64 over the blocks (the spans' bytes, so `spans` is not read): read where they lie by one
    kernel taking the block ids where it serves (a GPU), else gathered a layer at a time."""

    def __init__(self, kv: PagedKV, blocks: Sequence[int], heads: HeadRange | None) -> None:
        self._kv, self._blocks, self._heads = kv, blocks, heads
        self._running = RunningTensorChecksum()
        self._words = kv.block_words(heads) if blocks_in_place(kv.device) else None
        self._ids: torch.Tensor | None = None  # on the device, made on the stream that reads them

    def add_layers(self, layers: range, spans: SpanList | None = None) -> None:
        if self._words is None:
            for run in self._kv.gathered_bytes(self._blocks, self._heads, layers, GATHER_BYTES):
                self._running.add(run)
            return
        if self._ids is None:
            self._ids = self._kv.device_ids(self._blocks)
        for words in self._words[layers.start : layers.stop]:
            self._running.add_blocks(words, self._ids)

    @property
    def value(self) -> int:
        return self._running.value


def warm_up(kv: PagedKV) -> None:
    """The device checksum once over one block of every layer: on a GPU this builds the in-place
    kernel for the cache's own strides (Triton types integer arguments by their size) at the
    engine's start, not on a transfer's path."""
    running = DeviceChunkChecksum(kv, [0], None)
    running.add_layers(range(kv.num_layers))
    _ = running.value


def chunk_checksum(
    kv: PagedKV, algo: ChecksumAlgo, blocks: Sequence[int], heads: HeadRange | None
) -> ChunkChecksum:
    if algo is ChecksumAlgo.NH64:
        return DeviceChunkChecksum(kv, blocks, heads)
    return HostChunkChecksum(kv, blocks, heads)
