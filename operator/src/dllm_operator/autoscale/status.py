"""status.autoscaling from a decision, and whether it is worth a write or an Event. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from dllm_operator.autoscale.decide import Decision

# Signal values change with every read: status carries fresh ones at most this often unless a
# recommendation changes (so advisory mode does not write every poll).
REFRESH_SECONDS = 60.0


def status_of(decision: Decision, at: float) -> dict[str, Any]:
    out: dict[str, Any] = {"decidedAt": datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    for role, found in decision.roles.items():
        entry: dict[str, Any] = {
            "replicas": found.replicas,
            "current": found.current,
            "measure": found.measure,
            "reason": found.reason[:1024],
        }
        if found.value is not None:
            entry["value"] = round(found.value, 6)
        out[role] = entry
    return out


def recommended(status: Mapping[str, Any] | None) -> dict[str, int]:
    """The replicas a status.autoscaling (or its dict) recommends, by role."""
    return {
        role: int(status[role]["replicas"])
        for role in ("prefill", "decode")
        if status and isinstance(status.get(role), Mapping) and "replicas" in status[role]
    }


def worth_writing(previous: Mapping[str, Any] | None, decision: Decision, last_at: float, now: float) -> bool:
    """A changed recommendation always; fresh values only every REFRESH_SECONDS."""
    changed = recommended(previous) != {role: r.replicas for role, r in decision.roles.items()}
    return changed or now - last_at >= REFRESH_SECONDS
