"""What a pod says of itself, as the operator reads it. Pure."""

from __future__ import annotations

from typing import Any


def is_ready(pod: dict[str, Any]) -> bool:
    """Ready, and not on its way out (a terminating pod takes no new work)."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
