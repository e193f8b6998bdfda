"""Spans of memory, (address, length) runs in order, merged where they are contiguous (fewer, larger
writes and checksum reads). Pure: no torch."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_connector.layout.tp_mapping import LayoutError


def coalesce(
    src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Merge neighbouring span pairs that are contiguous on both sides (fewer, larger writes)."""
    merged_src: list[tuple[int, int]] = []
    merged_dst: list[tuple[int, int]] = []
    for (s_addr, length), (d_addr, d_length) in zip(src, dst, strict=True):
        if length != d_length:
            raise LayoutError(f"span of {length} bytes paired with one of {d_length}")
        if (
            merged_src
            and merged_src[-1][0] + merged_src[-1][1] == s_addr
            and merged_dst[-1][0] + merged_dst[-1][1] == d_addr
        ):
            merged_src[-1] = (merged_src[-1][0], merged_src[-1][1] + length)
            merged_dst[-1] = (merged_dst[-1][0], merged_dst[-1][1] + length)
        else:
            merged_src.append((s_addr, length))
            merged_dst.append((d_addr, length))
    return merged_src, merged_dst


def coalesce_runs(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge neighbouring spans that are contiguous (the same bytes in the same order, fewer runs)."""
    merged: list[tuple[int, int]] = []
    for addr, length in spans:
        if merged and merged[-1][0] + merged[-1][1] == addr:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((addr, length))
    return merged
