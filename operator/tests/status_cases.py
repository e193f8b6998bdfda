"""A role's workload and pods as the API server shows them, for status tests."""

from __future__ import annotations

from typing import Any


def pod(*container_statuses: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny-cpu-decode-0"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": list(container_statuses),
        },
    }


def workload(ready: int) -> dict[str, Any]:
    counts = {"observedGeneration": 1, "replicas": 1, "readyReplicas": ready, "updatedReplicas": 1}
    return {"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": counts}


def role_pod(name: str, ready: bool) -> dict[str, Any]:
    running = {"name": "engine", "ready": ready, "started": True, "restartCount": 0}
    return {**pod(running, ready=ready), "metadata": {"name": name}}
