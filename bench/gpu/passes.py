"""Which kernel sets a run measures, in which order, and the name of the set that ran."""

from __future__ import annotations

from typing import Any


def passes(device: Any, quick: bool, compiled: bool) -> list[tuple[str, str]]:
    """(codec kernel set, checksum kernel) per pass: plain torch ops first, so that a run cut short
    still has them; then torch.compile's (skipped by --no-compiled, and by --quick on a CPU, where
    compiling takes a minute of two cores)."""
    plain = [("plain", "eager")]
    return plain if not compiled or (quick and device.type == "cpu") else [*plain, ("compiled", "compiled")]


def label(kv_dtype: Any, device: Any) -> str:
    """The set that runs on `device` after `codec.use_kernels`: on a device, torch.compile's unless
    plain ops were asked for or the compiled ones write other bytes there (a warning says so)."""
    from dllm_connector import codec

    return codec.device_kernels(device, kv_dtype).name
