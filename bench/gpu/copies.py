"""Copies between the device and the host: to pinned memory and back, and to pageable memory."""

from __future__ import annotations

from typing import Any

from gpu.timing import gbps, seconds

COPY_BYTES_MAX = 1 << 30


def copy_rows(kv: Any, device: Any, repeats: int) -> dict[str, Any]:
    import torch

    if device.type == "cpu":
        return {"skipped": "no device: the CPU is the host"}
    source = kv.view(-1).view(torch.uint8)[:COPY_BYTES_MAX]
    pinned = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(source.numel(), dtype=torch.uint8)
    back = torch.empty_like(source)
    row = {
        "bytes": int(source.numel()),
        "to_pinned_gbps": gbps(
            source.numel(), seconds(lambda: pinned.copy_(source, non_blocking=True), device, repeats)
        ),
        "from_pinned_gbps": gbps(
            source.numel(), seconds(lambda: back.copy_(pinned, non_blocking=True), device, repeats)
        ),
        "to_pageable_gbps": gbps(source.numel(), seconds(lambda: pageable.copy_(source), device, repeats)),
    }
    row["round_trip_equal"] = bool(torch.equal(back, source))
    return row
