"""What a rollout shows in status (issue 34). Pure.

Per engine role, the KV fingerprint its pod template carries (what new pods get) and the fingerprints
its pods carry now, with how many of each are ready: mid-rollout, two. For the resource, when the
latest rollout started and when it completed, carried from the previous status the way a condition's
lastTransitionTime is: a rollout starts when RolloutProgressing leaves Complete and completes when it
returns to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from dllm_operator.pods import going, is_ready, kv_fingerprint
from dllm_operator.render import labels

COMPLETE = "Complete"  # RolloutProgressing's reason when every pod is at its role's template


def fingerprints(workload: Mapping[str, Any] | None, pods: list[dict[str, Any]]) -> dict[str, Any]:
    """`kvFingerprint` (the template's) and `podFingerprints` (the pods' own, going pods aside)."""
    out: dict[str, Any] = {}
    template = (workload or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    if fingerprint := template.get(labels.KV_FINGERPRINT):
        out["kvFingerprint"] = str(fingerprint)
    found: Counter[str] = Counter()
    ready: Counter[str] = Counter()
    for pod in pods:
        if going(pod):
            continue  # going: counted no more
        found[kv_fingerprint(pod)] += 1
        ready[kv_fingerprint(pod)] += is_ready(pod)
    if found:
        out["podFingerprints"] = [
            {"fingerprint": fingerprint, "pods": count, "ready": ready[fingerprint]}
            for fingerprint, count in sorted(found.items())
        ]
    return out


def times(reason: str, previous: Mapping[str, Any] | None, now: str) -> dict[str, str | None]:
    """`startedAt` and `completedAt` of the latest rollout, given RolloutProgressing's reason now. A new
    rollout carries `completedAt: None`: the status is written as a merge patch, where null removes the
    previous rollout's completion (compare statuses with status.without_times, which drops it)."""
    earlier = (previous or {}).get("rollout") or {}
    before = {
        key: str(value) for key in ("startedAt", "completedAt") if (value := earlier.get(key)) is not None
    }
    running_before = "startedAt" in before and "completedAt" not in before
    if reason != COMPLETE:
        return dict(before) if running_before else {"startedAt": now, "completedAt": None}
    if running_before:
        return {**before, "completedAt": now}
    return dict(before)
