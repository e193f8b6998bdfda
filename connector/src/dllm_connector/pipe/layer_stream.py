"""A staged chunk decoded and placed into paged KV a few layers at a time, as its pieces arrive."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from dllm_connector import codec
from dllm_connector.layout import HeadRange, LayoutError, PagedKV
from dllm_connector.pipe.common import TransferFailed
from dllm_connector.pipe.device_copy import HostMirror
from dllm_connector.pipe.durations import SecondsTotal
from dllm_connector.pipe.messages import bounded


class LayerStream:
    """A staged chunk decoded and placed a few layers at a time, as its pieces arrive.

    A decode error stops the placing; it is raised at `finish`, once the chunk's messages were all
    read, so the side channel stays in step. The places hold unverified KV until `finish`
    verified the checksum; if it raises, the load fails and reports those blocks.
    """

    def __init__(
        self,
        kv: PagedKV,
        draft: codec.KVHeader,
        view: torch.Tensor,
        blocks: Sequence[int],
        heads: HeadRange | None,
        failed: Callable[[], str],
        *,
        mirror: HostMirror | None = None,
        clock: SecondsTotal | None = None,
    ) -> None:
        """`mirror` (pinned-host path): `view` is host staging, decoded from the mirror's device
        scratch once each piece's layers were copied there; `clock` is given the seconds spent
        decoding and placing."""
        self._kv, self._draft, self._blocks, self._heads = kv, draft, blocks, heads
        self._failed = failed  # the expectation's failure: once set, nothing more is placed (H5)
        self._error: Exception | None = None
        self._mirror = mirror
        self._clock = clock
        try:
            self._decode = codec.StreamingDecode(
                draft, view if mirror is None else mirror.work, kv.num_layers
            )
        except codec.CodecError as error:  # raised at `finish`, once the chunk's messages were read
            self._error = error

    def place_until(self, layers: int) -> None:
        if self._error is None and self._failed():
            self._error = TransferFailed(f"the load failed elsewhere: {self._failed()}")
        if self._error is not None:
            return
        began = time.perf_counter()
        try:
            done = self._decode.decoded
            if self._mirror is not None and layers > done:
                per_layer = self._draft.shape[0] // self._kv.num_layers
                self._mirror.to_device(self._draft.ranges(done * per_layer, (layers - done) * per_layer))
            parts = self._decode.parts_until(layers)
            self._kv.scatter_layers(self._blocks, parts, self._heads, layers=range(done, layers))
        except (codec.CodecError, LayoutError) as error:
            self._error = error
        if self._clock is not None:
            self._clock.add(time.perf_counter() - began)

    def finish(self, header: codec.KVHeader) -> None:
        """The rest of the chunk placed, then the whole of it verified against its header."""
        check_header(header, self._draft)
        self.place_until(self._kv.num_layers)
        if self._error is not None:
            raise self._error
        self._decode.verify(header.checksum)


def check_header(header: codec.KVHeader, draft: codec.KVHeader) -> None:
    """A chunk's header must be the one decode worked out from its own layout (H6): a peer's
    codec, dtype, groups, shape or checksum algorithm never choose how decode reads its memory."""
    if header.same_layout(draft) and header.checksum_algo is not draft.checksum_algo:
        raise TransferFailed(
            f"prefill checksums the KV with {header.checksum_algo.value}, decode with "
            f"{draft.checksum_algo.value}: both engines need the same data path"
        )
    if replace(header, checksum=0) != draft:
        theirs = bounded(header.to_dict() | {"checksum": None})
        raise TransferFailed(f"KV chunk header {theirs} does not match this cache's layout")
