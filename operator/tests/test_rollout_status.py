"""What a rollout shows in status: each role's template fingerprint and its pods' fingerprints with
their ready counts, and when the latest rollout started and completed, carried across recomputations."""

from __future__ import annotations

from typing import Any

from dllm_operator.render import labels
from dllm_operator.rollout_status import fingerprints, times
from dllm_operator.status import without_times

T0, T1, T2 = "2026-12-06T10:00:00Z", "2026-12-06T10:05:00Z", "2026-12-06T10:09:00Z"


def pod(fingerprint: str, ready: bool = True, going: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": {labels.KV_FINGERPRINT: fingerprint}}
    if going:
        metadata["deletionTimestamp"] = T0
    return {"metadata": metadata, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_a_role_mid_rollout_shows_both_fingerprints_and_how_many_pods_of_each_are_ready() -> None:
    workload = {"spec": {"template": {"metadata": {"labels": {labels.KV_FINGERPRINT: "new"}}}}}
    pods = [pod("old"), pod("old", going=True), pod("new"), pod("new", ready=False)]
    assert fingerprints(workload, pods) == {
        "kvFingerprint": "new",
        "podFingerprints": [
            {"fingerprint": "new", "pods": 2, "ready": 1},
            {"fingerprint": "old", "pods": 1, "ready": 1},  # the going pod counts no more
        ],
    }
    assert fingerprints(None, []) == {}


def test_started_and_completed_times_follow_rollout_progressing() -> None:
    assert times("Complete", None, T0) == {}  # never rolled
    started = times("RollingOut", None, T0)
    assert started == {"startedAt": T0, "completedAt": None}  # null: the merge patch removes an old one
    assert times("RollingOut", {"rollout": started}, T1) == {"startedAt": T0}  # recomputed: unchanged
    assert times("Paused", {"rollout": started}, T1) == {"startedAt": T0}  # a pause: the same rollout
    done = times("Complete", {"rollout": started}, T1)
    assert done == {"startedAt": T0, "completedAt": T1}
    assert times("Complete", {"rollout": done}, T2) == done
    assert times("RollingOut", {"rollout": done}, T2) == {"startedAt": T2, "completedAt": None}  # the next
    written = {"startedAt": T2}  # as the API server keeps it after the merge patch
    assert times("RollingOut", {"rollout": written}, T2) == written


def test_a_written_rollout_start_compares_equal_to_what_the_api_server_kept() -> None:
    """The null that removed the old completedAt is gone once written: no second write for it."""
    sent = {"rollout": {"startedAt": T2, "completedAt": None}}
    kept = {"rollout": {"startedAt": T2}}
    assert without_times(sent) == without_times(kept)
    assert without_times(sent) != without_times({"rollout": {"startedAt": T0}})
