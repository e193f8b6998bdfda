"""What a pod says of itself, as the operator reads it. Pure."""

from __future__ import annotations

from typing import Any

from dllm_operator.render import labels


def is_ready(pod: dict[str, Any]) -> bool:
    """Ready, and not on its way out (a terminating pod takes no new work)."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def kv_fingerprint(pod: dict[str, Any]) -> str:
    """The pod's KV fingerprint label ("" when it has none)."""
    return str(pod.get("metadata", {}).get("labels", {}).get(labels.KV_FINGERPRINT) or "")
