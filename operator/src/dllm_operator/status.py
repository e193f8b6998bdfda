"""Pure status: what the children and their pods say, as api.md's status with conditions.

lastTransitionTime moves only when a condition's status flips; everything else is recomputed from the
observed objects every time, so the status is level-based and a repeated computation is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dllm_operator import kv_transfer, rollout, rollout_status
from dllm_operator.api import DisaggregatedLLM
from dllm_operator.kv_transfer import KVCheckView, KVFinding
from dllm_operator.pods import going
from dllm_operator.render import labels
from dllm_operator.render.router import endpoint

CONDITION_TYPES = (
    "Ready",
    "Progressing",
    "Degraded",
    "PrefillReady",
    "DecodeReady",
    "RouterReady",
    kv_transfer.CONDITION,
    "RolloutProgressing",
)
_WAITING_FAILURES = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Observed:
    """The CR's children as last seen: workloads by component, pods by component, apply failures."""

    workloads: Mapping[str, dict[str, Any]]
    pods: Mapping[str, list[dict[str, Any]]]
    apply_errors: tuple[str, ...] = ()
    create_failures: tuple[str, ...] = ()  # why a workload's controller could not create its pods
    kv_check: KVCheckView | None = None  # what the router pods' KV checks say (kv_transfer.py)
    rollouts_overdue: tuple[str, ...] = ()  # StatefulSets whose surge rollout passed its deadline
    autoscaling: Mapping[str, Any] | None = None  # status.autoscaling, the autoscaler's latest (autoscale/)


def missing_pods(workload: dict[str, Any] | None, pods: list[dict[str, Any]]) -> bool:
    """The workload wants more pods than exist: its controller may be failing to create them. Pods
    going (a rollout moved its window past them, a scale-down) are not counted: they do not stand in
    for one the controller failed to make."""
    if workload is None:
        return False
    staying = [pod for pod in pods if not going(pod)]
    return int(workload.get("spec", {}).get("replicas") or 0) > len(staying)


def replica_failure(deployment: dict[str, Any] | None) -> str | None:
    """A Deployment's ReplicaFailure condition (its ReplicaSet could not create a pod), if set."""
    for condition in (deployment or {}).get("status", {}).get("conditions", []):
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            name = deployment["metadata"]["name"] if deployment else "?"
            return f"Deployment {name}: {condition.get('reason', '')}: {condition.get('message', '')}"
    return None


def _pod_condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c.get("type") == kind), None)


def pod_problem(pod: dict[str, Any]) -> str | None:
    """Why a pod is broken (not merely starting), or None."""
    name = pod["metadata"]["name"]
    scheduled = _pod_condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return f"{name} Unschedulable: {scheduled.get('message', '')}".strip()
    statuses = pod.get("status", {}).get("containerStatuses", [])
    for status in statuses:
        waiting = status.get("state", {}).get("waiting", {})
        if waiting.get("reason") in _WAITING_FAILURES:
            return f"{name} {waiting['reason']}: {waiting.get('message', '')}".strip()
    for status in statuses:
        # A container that died and is not back yet (a crash, an OOM kill): the pod is broken until
        # it is ready again, not merely starting, even while the startup probe runs anew.
        ended = status.get("lastState", {}).get("terminated")
        if ended and not status.get("ready"):
            exit_code, why = ended.get("exitCode", "?"), ended.get("reason") or "exited"
            return f"{name} restarting: container {status.get('name', '?')} {why} (exit code {exit_code})"
    ready = _pod_condition(pod, "Ready")
    # The kubelet reports started=false until the startup probe passes (a loading model is not broken).
    started = bool(statuses) and all(s.get("started", True) for s in statuses)
    if (
        ready
        and ready.get("status") == "False"
        and started
        and pod.get("status", {}).get("phase") == "Running"
    ):
        return f"{name} not ready: {ready.get('message') or ready.get('reason') or 'readiness probe failing'}"
    return None


def _ready_pods(pods: list[dict[str, Any]]) -> int:
    return sum(1 for pod in pods if (ready := _pod_condition(pod, "Ready")) and ready.get("status") == "True")


def _counts(workload: dict[str, Any] | None, pods: list[dict[str, Any]]) -> tuple[int, int, int, int, bool]:
    """desired, existing, ready, updated, and whether the controller has seen the latest spec.

    Ready counts no more pods than the pods themselves say are ready: the workload's own count comes
    later (its controller writes it after the pod changed), and the status must not call a role ready
    beside a Degraded that names its pod not ready."""
    if workload is None:
        return 0, 0, 0, 0, False
    spec, status = workload.get("spec", {}), workload.get("status", {})
    desired = int(spec.get("replicas", 1))
    ready = int(status.get("readyReplicas", 0))
    if pods:
        ready = min(ready, _ready_pods(pods))
    updated = int(status.get("updatedReplicas", 0))
    return desired, int(status.get("replicas", 0)), ready, updated, rollout.observed(workload)


def role_status(cr: DisaggregatedLLM, component: labels.Component, observed: Observed) -> dict[str, Any]:
    desired, existing, ready, updated, _ = _counts(
        observed.workloads.get(component), observed.pods.get(component, [])
    )
    status: dict[str, Any] = {
        "replicas": existing,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "ready": f"{ready}/{desired}",
    }
    if component != "router":  # the scale subresources' selectors; the KV fingerprints of a rollout
        status["selector"] = labels.selector_string(cr, component)
        status |= rollout_status.fingerprints(
            observed.workloads.get(component), observed.pods.get(component, [])
        )
    return status


def role_condition(kind: str, component: str, observed: Observed) -> Condition:
    workload = observed.workloads.get(component)
    if workload is None:
        return Condition(kind, False, "NotCreated", f"the {component} workload does not exist yet")
    desired, existing, ready, updated, current = _counts(workload, observed.pods.get(component, []))
    if desired == 0:
        return Condition(kind, False, "ScaledToZero", f"{component} has 0 replicas")
    if not current:
        return Condition(kind, False, "Updating", f"the {component} controller has not seen the latest spec")
    if ready >= desired and updated >= desired and existing == desired:
        return Condition(kind, True, "AllReplicasReady", f"{ready}/{desired} {component} pods ready")
    return Condition(
        kind, False, "ReplicasNotReady", f"{ready}/{desired} {component} pods ready, {updated} updated"
    )


def _degraded(observed: Observed, kv: KVFinding) -> Condition:
    problems = [*observed.apply_errors, *observed.create_failures]
    for component in ("prefill", "decode", "router"):
        problems += [p for pod in observed.pods.get(component, []) if (p := pod_problem(pod))]
    if kv.failed:
        problems.append(f"KV transfer {kv.reason}: {kv.message}")
    for name in observed.rollouts_overdue:
        problems.append(f"{name}: rollout stopped, its new pods not ready within the progress deadline")
    if not problems:
        return Condition("Degraded", False, "AsExpected")
    if observed.apply_errors:
        reason = "ApplyFailed"
    elif observed.create_failures:
        reason = "FailedCreate"
    elif len(problems) == 1 and kv.failed:
        reason = kv.reason
    elif observed.rollouts_overdue and len(problems) == len(observed.rollouts_overdue):
        reason = "ProgressDeadlineExceeded"
    else:
        reason = "Unschedulable" if any("Unschedulable" in p for p in problems) else "PodsNotHealthy"
    return Condition("Degraded", True, reason, "; ".join(problems)[:4000])


def _rolling(workload: dict[str, Any] | None, desired: int | None) -> str | None:
    """What a role's StatefulSet still has to do to be at its template, in words; None when nothing."""
    if workload is None:
        return None
    spec, status = workload.get("spec", {}), workload.get("status", {})
    name = workload.get("metadata", {}).get("name", "?")
    replicas = int(spec.get("replicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    if status.get("currentRevision") != status.get("updateRevision"):
        partition = (spec.get("updateStrategy", {}).get("rollingUpdate") or {}).get("partition", 0)
        return f"{name}: {updated}/{replicas} pods at the new template (partition {partition})"
    if desired is not None and replicas > desired:
        return f"{name}: {replicas - desired} surge pods to go"
    return None


def rollout_condition(cr: DisaggregatedLLM, observed: Observed) -> Condition:
    """RolloutProgressing: True while an engine role's pods move to its template (issue 34)."""
    steps = [
        step
        for role, spec in (("prefill", cr.spec.prefill), ("decode", cr.spec.decode))
        if (step := _rolling(observed.workloads.get(role), spec.replicas))
    ]
    if not steps:
        return Condition(
            "RolloutProgressing", False, rollout_status.COMPLETE, "every engine pod is at its role's template"
        )
    if observed.rollouts_overdue:
        deadline = cr.spec.rollout.progress_deadline_seconds
        stalled = ", ".join(observed.rollouts_overdue)
        return Condition(
            "RolloutProgressing",
            False,
            "ProgressDeadlineExceeded",
            f"{stalled}: no step in {deadline}s; stopped, the old pods serving: " + "; ".join(steps),
        )
    if cr.spec.rollout.paused:
        return Condition("RolloutProgressing", False, "Paused", "; ".join(steps))
    return Condition("RolloutProgressing", True, "RollingOut", "; ".join(steps))


def kv_condition(found: KVFinding) -> Condition:
    return Condition(kv_transfer.CONDITION, found.status, found.reason, found.message)


def conditions(cr: DisaggregatedLLM, observed: Observed, kv: KVFinding | None = None) -> list[Condition]:
    """Every condition; `kv` is the KV check's finding when the caller has it already."""
    prefill = role_condition("PrefillReady", "prefill", observed)
    decode = role_condition("DecodeReady", "decode", observed)
    if cr.spec.router.enabled:
        router = role_condition("RouterReady", "router", observed)
    else:
        router = Condition("RouterReady", True, "Disabled", "router.enabled is false")
    kv = kv if kv is not None else kv_transfer.finding(observed.kv_check)
    degraded = _degraded(observed, kv)
    not_ready = [c for c in (prefill, decode, router) if not c.status]
    if not_ready:
        ready = Condition("Ready", False, not_ready[0].reason, "; ".join(c.message for c in not_ready))
    elif kv.failed:  # every pod is ready, and the KV check shows the path broken
        ready = Condition("Ready", False, kv.reason, f"every role is ready; KV transfer: {kv.message}")
    else:
        ready = Condition("Ready", True, "AllRolesReady", "prefill, decode and router are ready")
    if ready.status:
        progressing = Condition("Progressing", False, "Complete", "every role is at the current spec")
    elif degraded.status:
        progressing = Condition("Progressing", False, "Stalled", degraded.message)
    else:
        progressing = Condition("Progressing", True, "RollingOut", ready.message)
    return [
        ready,
        progressing,
        degraded,
        prefill,
        decode,
        router,
        kv_condition(kv),
        rollout_condition(cr, observed),
    ]


def _as_dict(
    condition: Condition, generation: int, previous: Mapping[str, dict[str, Any]], now: str
) -> dict[str, Any]:
    status = {True: "True", False: "False", None: "Unknown"}[condition.status]
    before = previous.get(condition.type)
    flipped = before is None or before.get("status") != status
    return {
        "type": condition.type,
        "status": status,
        "reason": condition.reason,
        "message": condition.message,
        "lastTransitionTime": now if flipped else before["lastTransitionTime"],  # type: ignore[index]
        "observedGeneration": generation,
    }


def compute_status(
    cr: DisaggregatedLLM, observed: Observed, previous: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    before = {c["type"]: c for c in (previous or {}).get("conditions", []) if "type" in c}
    generation = cr.metadata.generation
    kv = kv_transfer.finding(observed.kv_check)
    found = conditions(cr, observed, kv)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "prefill": role_status(cr, "prefill", observed),
        "decode": role_status(cr, "decode", observed),
        "router": role_status(cr, "router", observed),
        "endpoint": endpoint(cr) if cr.spec.router.enabled else "",
        "conditions": [_as_dict(c, generation, before, now) for c in found],
    }
    rolled = next(c for c in found if c.type == "RolloutProgressing")
    if times := rollout_status.times(rolled.reason, previous, now):
        status["rollout"] = times
    if observed.kv_check is not None and observed.kv_check.checked:
        status["kvTransfer"] = kv_transfer.status_of(kv)
    if observed.autoscaling is not None:
        status["autoscaling"] = dict(observed.autoscaling)
    return status


def invalid_spec_status(
    generation: int, message: str, previous: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    """A spec the operator refuses (it passed admission, e.g. an older CRD): say why, change nothing."""
    before = {c["type"]: c for c in (previous or {}).get("conditions", []) if "type" in c}
    found = [
        Condition("Ready", False, "InvalidSpec", message),
        Condition("Degraded", True, "InvalidSpec", message),
        Condition("Progressing", False, "InvalidSpec", message),
    ]
    kept = [
        c
        for c in (previous or {}).get("conditions", [])
        if c.get("type") not in ("Ready", "Degraded", "Progressing")
    ]
    return {
        **(previous or {}),
        "observedGeneration": generation,
        "conditions": [_as_dict(c, generation, before, now) for c in found] + list(kept),
    }


def without_times(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """For comparing two statuses: transition times aside, and a rollout's null fields (a merge patch's
    removals, absent once written)."""
    status = dict(status or {})
    status["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions", [])
    ]
    if "rollout" in status:
        status["rollout"] = {k: v for k, v in status["rollout"].items() if v is not None}
    return status


def workloads_by_component(children: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The StatefulSets and the Deployment among a CR's children, by the component their label names."""
    return {
        component: child
        for child in children
        if child.get("kind") in ("StatefulSet", "Deployment")
        and (component := child.get("metadata", {}).get("labels", {}).get(labels.COMPONENT, ""))
        in ("prefill", "decode", "router")
    }


def pods_by_component(pods: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        component = pod.get("metadata", {}).get("labels", {}).get(labels.COMPONENT, "")
        grouped.setdefault(component, []).append(pod)
    return grouped
