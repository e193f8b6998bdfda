"""Timing on a device: medians with the device idle around each call, GB/s, and host syncs counted."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(run: Callable[[], object], device: Any, repeats: int) -> float:
    """Median wall time of `run` after one warm-up call, the device idle before and after each."""
    run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, elapsed: float) -> float:
    return round(nbytes / elapsed / 1e9, 3)


def count_syncs(run: Callable[[], object], device: Any) -> int | None:
    """Host syncs during `run` (CUDA's sync debug mode: one warning per synchronizing call)."""
    import torch

    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)
