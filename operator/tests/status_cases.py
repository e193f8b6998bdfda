"""A role's workload and pods as the API server shows them, for status tests."""

from __future__ import annotations

from typing import Any

from dllm_cases import minimal

from dllm_operator.api import parse
from dllm_operator.kv_transfer import KVCheckView
from dllm_operator.status import Observed, compute_status


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


def sample_status(decode_pod_ready: bool = True, kv_check: KVCheckView | None = None) -> dict[str, Any]:
    """The status of a resource whose three workloads count one ready pod each, as the pods say."""
    observed = Observed(
        workloads={"prefill": workload(1), "decode": workload(1), "router": workload(1)},
        pods={
            "prefill": [role_pod("tiny-cpu-prefill-0", True)],
            "decode": [role_pod("tiny-cpu-decode-0", decode_pod_ready)],
            "router": [role_pod("tiny-cpu-router-x", True)],
        },
        kv_check=kv_check,
    )
    return compute_status(parse(minimal("tiny-cpu")), observed, None, "2026-12-06T00:00:00Z")
