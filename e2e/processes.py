"""Processes under a pid, read from /proc: what a test freezes or kills inside an engine."""

from __future__ import annotations

import contextlib
from pathlib import Path


def descendants(pid: int) -> dict[int, str]:
    """Every process under `pid`, with its name (/proc/PID/comm: vLLM's process titles)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            child = int(stat.parent.name)
            parents[child] = int(text.rsplit(")", 1)[1].split()[1])
            names[child] = (stat.parent / "comm").read_text().strip()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = names.get(child, "")
                frontier.append(child)
    return found
