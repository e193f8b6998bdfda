"""What a pod says of itself, as the operator reads it. Pure."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from dllm_operator.render import labels


def going(pod: dict[str, Any]) -> bool:
    """Deleted, on its way out (draining through its preStop, or on a node that is gone)."""
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def is_ready(pod: dict[str, Any]) -> bool:
    """Ready, and not on its way out (a terminating pod takes no new work)."""
    if going(pod):
        return False
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def holds_resources(pod: dict[str, Any], now: float) -> bool:
    """The pod still holds what it runs on (a GPU): not deleted, or deleted and within its grace period
    (its deletionTimestamp, the time by which the kubelet kills it, not past yet). A pod past it whose
    object remains stands on a node that is gone or unreachable: it is not waited for."""
    return not going(pod) or _epoch(str(pod["metadata"]["deletionTimestamp"])) > now


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def settled(pod: dict[str, Any], now: float, seconds: float) -> bool:
    """Ready for at least `seconds` by `now` (seconds since the epoch), so that a router looking for
    pods every few seconds has found it. A Ready condition without a time counts as long ago."""
    if not is_ready(pod) or seconds <= 0:
        return is_ready(pod)
    ready = next(c for c in pod["status"]["conditions"] if c.get("type") == "Ready")
    since = ready.get("lastTransitionTime")
    if not since:
        return True
    return now - _epoch(str(since)) >= seconds


def kv_fingerprint(pod: dict[str, Any]) -> str:
    """The pod's KV fingerprint label ("" when it has none)."""
    return str(pod.get("metadata", {}).get("labels", {}).get(labels.KV_FINGERPRINT) or "")
