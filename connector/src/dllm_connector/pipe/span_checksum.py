"""The zero-copy checksum: over a cache's block spans, in order, on whichever side of PCIe the cache is.

XXH3-64 over host memory read in place (checksum.RunningChecksum) on the host path; on the device
path nh64 (device_checksum.RunningTensorChecksum) over byte views of the cache, computed where the
blocks are, so no block crosses to the host to be checked. Both are what codec.checksum gives for a
codec-none payload of the same bytes under that algorithm. Each side picks the algorithm from its
own data path and the header names it, so a peer on the other path is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable

from dllm_connector.checksum import RunningChecksum
from dllm_connector.codec import ChecksumAlgo
from dllm_connector.device_checksum import RunningTensorChecksum
from dllm_connector.kv_layout import PagedKV


class SpanChecksum:
    def __init__(self, kv: PagedKV, algo: ChecksumAlgo) -> None:
        self._kv = kv
        on_device = algo is ChecksumAlgo.NH64
        self._host = None if on_device else RunningChecksum()
        self._device = RunningTensorChecksum() if on_device else None

    def add(self, addr: int, nbytes: int) -> None:
        if self._device is not None:
            self._device.add(self._kv.byte_region(addr, nbytes))
        else:
            assert self._host is not None
            self._host.add(addr, nbytes)

    def add_all(self, spans: Iterable[tuple[int, int]]) -> None:
        if self._device is not None:  # gathered into long runs: one launch per span is launch-bound
            self._device.add_all(self._kv.byte_region(addr, nbytes) for addr, nbytes in spans)
            return
        for addr, nbytes in spans:
            self.add(addr, nbytes)

    @property
    def value(self) -> int:
        if self._device is not None:
            return self._device.value
        assert self._host is not None
        return self._host.value
