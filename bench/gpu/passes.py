"""Which kernel sets a run measures, in which order, and the name of the set that ran."""

from __future__ import annotations

from typing import Any


def passes(device: Any, quick: bool, compiled: bool) -> list[tuple[str, str]]:
    """(codec kernel set, checksum kernel) per pass: plain torch ops first, so that a run cut short
    still has them; then torch.compile's (skipped by --no-compiled, and by --quick on a CPU, where
    compiling takes a minute of two cores)."""
    plain = [("plain", "eager")]
    return plain if not compiled or (quick and device.type == "cpu") else [*plain, ("compiled", "compiled")]


def label(used: str, device: Any) -> str:
    """The set that ran: the native set runs plain torch ops on a device (where compiled was asked
    for and is unavailable, the next set serves, and says so in a warning)."""
    return "plain" if used == "native" and device.type != "cpu" else used
