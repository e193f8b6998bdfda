"""Two caches' handshake signatures compared, worded so that a peer's values never flood a log line.
Pure: no torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def signature_mismatches(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two caches' signatures (empty when they match).

    Each line starts with the field's name. The peer's values are cut to a few dozen characters
    and its extra fields are only counted (L2: a peer's data never floods a log line).
    """
    lines = [
        f"{key}: ours {_short(ours.get(key))}, peer {_short(theirs.get(key))}"
        for key in sorted(ours)
        if ours.get(key) != theirs.get(key)
    ]
    extra = len(set(theirs) - set(ours))
    if extra:
        lines.append(f"unknown fields: {extra} from the peer")
    return lines


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
