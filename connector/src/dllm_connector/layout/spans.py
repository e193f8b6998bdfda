"""Spans of memory, (address, length) runs in order, merged where they are contiguous (fewer, larger
checksum reads on the host path). Pure: no torch. A zero-copy chunk's writes are merged as arrays
(span_table)."""

from __future__ import annotations

from collections.abc import Sequence


def coalesce_runs(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge neighbouring spans that are contiguous (the same bytes in the same order, fewer runs)."""
    merged: list[tuple[int, int]] = []
    for addr, length in spans:
        if merged and merged[-1][0] + merged[-1][1] == addr:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((addr, length))
    return merged
