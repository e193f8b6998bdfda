"""Active mode (issue 36), pure: the replicas the operator sets for each role it scales, and the
resource rendered with them.

A step moves a role one replica toward its recommendation (decide.py has applied the window, the
bounds and the ratio). It waits while a rollout is under way (a surge counts from the replicas the
rollout started with). A step up waits until every pod of the role has been ready long enough to be
measured: the router has found it and the autoscaler has read the metrics once with it serving, so the
next step is judged on what the last one did. A step down waits only for the pods it keeps (the one it
removes, the highest ordinal, may be the pod a step up made that never became ready: no free GPU, say).
New bounds apply at once, as an HPA's do.

The count lives on the role's StatefulSet (APPLIED), so a restarted operator goes on from it; a
StatefulSet without it (a resource switched to active mode) starts from its own replicas, less the
surge while a rollout is under way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dllm_operator import rollout
from dllm_operator.api import DisaggregatedLLM
from dllm_operator.api.autoscaling import AutoscalingSpec
from dllm_operator.api.rollout import EngineRole, RolloutSpec
from dllm_operator.pods import settled
from dllm_operator.render.engine import AUTOSCALED_REPLICAS as APPLIED


@dataclass(frozen=True)
class Step:
    replicas: int
    reason: str  # what was done or why nothing was; "" when the role is where it should be


def bounds(spec: AutoscalingSpec, role: EngineRole) -> tuple[int, int]:
    scaled = spec.prefill if role == "prefill" else spec.decode
    assert scaled is not None, f"{role} is not autoscaled"
    return scaled.min_replicas, scaled.max_replicas


def within(count: int, low: int, high: int) -> int:
    return min(max(count, low), high)


def initial_replicas(
    spec: AutoscalingSpec, role: EngineRole, sts: dict[str, Any] | None, rollout_spec: RolloutSpec
) -> int:
    """The count to start from: the StatefulSet's record of it, else its replicas (less the surge of
    a rollout under way), else the minimum."""
    low, high = bounds(spec, role)
    if sts is None:
        return low
    recorded = str(sts.get("metadata", {}).get("annotations", {}).get(APPLIED, ""))
    if recorded.isdigit():
        return within(int(recorded), low, high)
    count = int(sts.get("spec", {}).get("replicas") or low)
    if rollout.rolling(sts) and rollout_spec.coordinated:
        count = rollout.replicas_without_surge(sts, rollout_spec.budget(role).surge)
    return within(count, low, high)


def measured(pods: Iterable[dict[str, Any]], replicas: int, now: float, seconds: float) -> bool:
    """Every one of the role's `replicas` pods has been ready for `seconds`, and no other pod is left."""
    pods = list(pods)
    return len(pods) == replicas and all(settled(pod, now, seconds) for pod in pods)


def kept_measured(pods: Iterable[dict[str, Any]], start: int, keep: int, now: float, seconds: float) -> bool:
    """The `keep` lowest ordinals from the StatefulSet's `start` (what a step down to `keep` leaves)
    exist and are measured."""
    window = range(start, start + keep)
    kept = [pod for pod in pods if (ordinal := rollout.ordinal_of(pod)) is not None and ordinal in window]
    return measured(kept, keep, now, seconds)


def next_replicas(
    applied: int, recommended: int, low: int, high: int, *, measured: bool, rolling: bool, kept_measured: bool
) -> Step:
    """One step of a role from `applied` toward `recommended` (see the module's docstring)."""
    bounded = within(applied, low, high)
    if bounded != applied:
        return Step(bounded, f"scaled {applied} to {bounded}: the bounds are {low}..{high}")
    wanted = within(recommended, low, high)
    if wanted == applied:
        return Step(applied, "")
    held = f"held at {applied} (recommended {wanted})"
    if rolling:
        return Step(applied, f"{held}: a rollout is under way")
    up = wanted > applied
    if not (measured if up else kept_measured):
        return Step(applied, f"{held}: the last step's pods are not measured yet")
    toward = applied + (1 if up else -1)
    return Step(toward, f"scaled {applied} to {toward}, one step toward {wanted}")


def with_applied(cr: DisaggregatedLLM, counts: Mapping[EngineRole, int]) -> DisaggregatedLLM:
    """The resource as if each role's replicas in `counts` were set in its spec (so rendering, the
    rollout's surge and the status read them as a hand-set count)."""
    spec = cr.spec
    roles: dict[str, Any] = {
        role: getattr(spec, role).model_copy(update={"replicas": count}) for role, count in counts.items()
    }
    return cr.model_copy(update={"spec": spec.model_copy(update=roles)})
