"""The `host` data path's override on a device cache: each gathered layer copied to host memory before
the codec sees it, so encoding and checksumming run on host cores with the host's kernels, as the
override promises (gpu-review item 16). Handed device parts, the host's kernel set fell back to torch
ops on the device and copied each result back synchronously: the GPU did the work, and int8's bytes
were the device's, not the host's."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import torch

from dllm_connector.transport.staging import pinned_host_bytes


def encodes_on_host(kv_device: torch.device, staging_device: torch.device) -> bool:
    """A device cache staged in host memory (only the `host` override does that without a mirror)."""
    return kv_device.type != "cpu" and staging_device.type == "cpu"


class PinnedParts:
    """Page-locked host buffers for those copies, kept for the sender's life: pinning memory is slow (the
    driver maps every page), so a buffer is made per send in flight and reused, not made per chunk."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def copied(self, parts: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Each part copied into one page-locked buffer (valid until the next is taken, as
        `PagedKV.gather_layers` promises for its own parts), grown for a larger part; the buffer goes
        back for the next chunk once the parts are consumed."""
        with self._lock:
            buffer = self._free.pop() if self._free else None
        try:
            for part in parts:
                nbytes = part.numel() * part.element_size()
                if buffer is None or buffer.numel() < nbytes:
                    buffer, _ = pinned_host_bytes(nbytes)
                host = buffer[:nbytes].view(part.dtype).view(part.shape)
                host.copy_(part)  # waits for the gather: the codec reads it next, on the host
                yield host
        finally:
            if buffer is not None:
                with self._lock:
                    self._free.append(buffer)
