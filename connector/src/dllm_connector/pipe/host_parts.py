"""The `host` data path's override on a device cache: each gathered layer copied to host memory before
the codec sees it, so encoding and checksumming run on host cores with the host's kernels, as the
override promises (gpu-review item 16). Handed device parts, the host's kernel set fell back to torch
ops on the device and copied each result back synchronously: the GPU did the work, and int8's bytes
were the device's, not the host's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from dllm_connector.transport.staging import pinned_host_bytes


def encodes_on_host(kv_device: torch.device, staging_device: torch.device) -> bool:
    """A device cache staged in host memory (only the `host` override does that without a mirror)."""
    return kv_device.type != "cpu" and staging_device.type == "cpu"


def parts_on_host(parts: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each part copied into one reused page-locked host buffer (valid until the next is taken, as
    `PagedKV.gather_layers` promises for its own parts)."""
    buffer: torch.Tensor | None = None
    for part in parts:
        nbytes = part.numel() * part.element_size()
        if buffer is None or buffer.numel() < nbytes:
            buffer, _ = pinned_host_bytes(nbytes)
        host = buffer[:nbytes].view(part.dtype).view(part.shape)
        host.copy_(part)  # waits for the gather: the codec reads it next, on the host
        yield host
