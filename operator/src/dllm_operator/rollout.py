"""Coordinated rollouts of the engine StatefulSets (spec.rollout, issue 34). Pure.

A StatefulSet cannot surge by itself: its rolling update takes a pod down before its replacement is up,
and a role with one replica has no pod meanwhile. With a role's maxSurge S and maxUnavailable U, the
operator rolls a role of N replicas through its StatefulSet's window of ordinals instead (spec.ordinals
.start, spec.replicas) and its partition, one step per reconcile, each step read from what the cluster
shows (so a restarted operator goes on where it was). The old pods are the lowest ordinals of the
window, as many as the partition (which counts from ordinals.start); the new ones are above them.

1. the pod template changed: replicas N + min(S, N), partition N. The new ordinals above the old pods
   start from the new template; the old pods keep serving.
2. while old pods remain: when every pod above the partition is at the new revision and ready, and the
   other role has a ready pod of the new KV fingerprint, ordinals.start moves up past as many old pods
   as keep N-U of the role's pods ready (S+U when every pod is ready; an old pod that is not ready
   costs nothing), so the StatefulSet deletes them (its preStop drains each) and the partition goes
   down as far; at the next step, new ordinals are added at the top, up to N new pods and N+S pods in
   all (not at once: the StatefulSet would create them before it deletes the old). A complete
   pair of the new fingerprint serves before either role's old pods go, and the router pairs only equal
   fingerprints, so no request meets a pod that cannot read its KV. With neither role surging no such
   pair can come first: prefill takes the first step alone while the old pairs serve (a role of one
   replica, or one that may lose all its pods at once, has none meanwhile).
3. no old pod left: replicas N, partition 0, the window N ordinals above where it began.

Each new pod is made once: the pods a surge brings up are the ones that stay (replacing old pods in
place, then taking the surge pods away, started most of them twice). Pod names move up by N each
rollout, as a Deployment's pods are named anew.

The roles move in step (spec.rollout.maxSkew): a role replaces old pods only while its share of old
pods replaced, after the step, is no more than maxSkew percent ahead of the other role's, or one pod
while it is not ahead at all (so one of them can always move, and neither waits on the other for ever).

A change back (a rollback) is a template change like any other; one made while a rollout runs waits
for it to finish (restarting from the mixed pods would take the newest ready ones down at once), unless
that rollout failed its deadline. `paused` holds the current step.
Replicas left to an autoscaler are never surged (the count is not the operator's to raise). Each step
stamps the StatefulSet (STEP_AT, seconds since the epoch); a rollout whose last step is older than its
progressDeadlineSeconds is failed and held there, the old pods serving, until the template changes.
Whatever the step, the window's start is kept (never rendered back to 0, which would replace every pod
at once); a StatefulSet made again (an immutable field changed) starts where its orphaned pods are.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from dllm_operator.api.rollout import EngineRole, RoleBudget, RolloutSpec
from dllm_operator.pods import going, holds_resources, kv_fingerprint, settled
from dllm_operator.render import labels
from dllm_operator.render.engine import TEMPLATE_HASH

REVISION_LABEL = "controller-revision-hash"
STEP_AT = "disagg.dev/rollout-step-at"
# The role's own replicas, stamped at each step: mid-rollout the StatefulSet's replicas are not it.
ROLE_REPLICAS = "disagg.dev/rollout-replicas"
PAUSED = "paused"


def _annotation(obj: dict[str, Any], name: str) -> str | None:
    value = obj.get("metadata", {}).get("annotations", {}).get(name)
    return str(value) if value is not None else None


def partition_of(sts: dict[str, Any]) -> int:
    rolling = sts.get("spec", {}).get("updateStrategy", {}).get("rollingUpdate") or {}
    return int(rolling.get("partition") or 0)


def ordinal_of(pod: dict[str, Any]) -> int | None:
    suffix = pod.get("metadata", {}).get("name", "").rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else None


def start_of(sts: dict[str, Any] | None) -> int:
    """The StatefulSet's first ordinal (spec.ordinals.start; 0 when unset)."""
    ordinals = (sts or {}).get("spec", {}).get("ordinals") or {}
    return int(ordinals.get("start") or 0)


def window_start(actual: dict[str, Any] | None, pods: Iterable[dict[str, Any]]) -> int:
    """Where the role's window of ordinals begins now: the live StatefulSet's start, or, with none (it
    was deleted, orphaning its pods, for an immutable field), its lowest pod's ordinal but those going
    (left below the window by a rollout, still draining), so the one made again adopts the pods
    instead of replacing them all at once."""
    if actual is not None:
        return start_of(actual)
    staying = (pod for pod in pods if not going(pod))
    return min((o for pod in staying if (o := ordinal_of(pod)) is not None), default=0)


def with_start(desired: dict[str, Any], start: int) -> dict[str, Any]:
    """`desired` with its window starting at `start` (`desired` itself when that is 0, the default)."""
    if start == start_of(desired):
        return desired
    out = copy.deepcopy(desired)
    out["spec"]["ordinals"] = {"start": start}
    return out


def ready_fingerprints(pods: Iterable[dict[str, Any]], now: float = 0.0, settle: float = 0.0) -> set[str]:
    """The KV fingerprints of the pods among `pods` ready for `settle` seconds by `now`."""
    return {fingerprint for pod in pods if settled(pod, now, settle) and (fingerprint := kv_fingerprint(pod))}


def with_steps(
    desired: dict[str, Any], start: int, replicas: int, partition: int, at: float | None
) -> dict[str, Any]:
    """`desired` at this step: its window's start and replicas, its rolling update's partition, and when
    it was taken (None: paused, so no deadline runs; the first step after the pause starts it again)."""
    out = copy.deepcopy(with_start(desired, start))
    out["spec"]["replicas"] = replicas
    out["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}
    stamp = PAUSED if at is None else f"{at:.0f}"
    own = str(desired["spec"].get("replicas"))
    out["metadata"]["annotations"] = {
        **out["metadata"].get("annotations", {}),
        STEP_AT: stamp,
        ROLE_REPLICAS: own,
    }
    return out


def step_at(sts: dict[str, Any]) -> float | None:
    """When the rollout last took a step, from the StatefulSet's stamp."""
    value = _annotation(sts, STEP_AT)
    if value is None or not value.isdigit():
        return None  # none yet, or paused
    return float(value)


def rolling(sts: dict[str, Any]) -> bool:
    """Pods of the StatefulSet are not at its template yet."""
    status = sts.get("status", {})
    return bool(status.get("currentRevision") != status.get("updateRevision"))


def observed(sts: dict[str, Any]) -> bool:
    """The StatefulSet's controller has acted on its latest spec."""
    status = sts.get("status", {})
    return int(status.get("observedGeneration") or 0) >= int(sts.get("metadata", {}).get("generation") or 0)


def under_way(sts: dict[str, Any], replicas: int | None) -> bool:
    """Pods not at the template yet, or surge pods above the role's `replicas` still to go."""
    have = int(sts.get("spec", {}).get("replicas") or 0)
    return rolling(sts) or (replicas is not None and have > replicas)


def overdue(sts: dict[str, Any], rollout: RolloutSpec, now: float) -> bool:
    """A rollout under way whose last step is older than its deadline."""
    at = step_at(sts)
    return rolling(sts) and at is not None and now - at > rollout.progress_deadline_seconds


def _with_template_of(actual: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """`desired` with the pod template (and its hash) the live StatefulSet rolls out now."""
    out = copy.deepcopy(desired)
    out["spec"]["template"] = copy.deepcopy(actual["spec"]["template"])
    out["metadata"]["annotations"] = {
        **out["metadata"].get("annotations", {}),
        TEMPLATE_HASH: _annotation(actual, TEMPLATE_HASH) or "",
    }
    return out


def progress(desired: dict[str, Any], actual: dict[str, Any] | None) -> float:
    """How far one role's surge rollout is, from 0 to 1: the share of its old pods replaced. 1 when the
    role is not rolling (nothing to wait for), 0 when its template changed and no step was taken."""
    n = int(desired["spec"].get("replicas") or 0)
    if actual is None or not n:
        return 1.0
    if _annotation(actual, TEMPLATE_HASH) != _annotation(desired, TEMPLATE_HASH):
        return 0.0
    if not rolling(actual):
        return 1.0
    return _replaced(n, partition_of(actual))


def _replaced(n: int, partition: int) -> float:
    """The share of a role's n old pods replaced once the partition is at `partition`."""
    return (n - min(partition, n)) / n


def step(
    desired: dict[str, Any],
    actual: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    partner_pods: list[dict[str, Any]],
    rollout: RolloutSpec,
    now: float,
    partner_progress: float = 1.0,
    *,
    role: EngineRole,
    settle: float = 0.0,
) -> dict[str, Any]:
    """The StatefulSet to apply for `role` now: `desired` as rendered, at the rollout's current step.
    `pods` are the role's, `partner_pods` the other role's, `partner_progress` the other role's
    `progress`; `now` in seconds since the epoch. A new pod counts as serving once it has been ready
    `settle` seconds (the router finds pods on its own schedule): only then may an old one go."""
    start = window_start(actual, pods)
    n = desired["spec"].get("replicas")
    if not rollout.coordinated or n is None or n == 0 or actual is None:
        return with_start(desired, start)
    if _annotation(actual, TEMPLATE_HASH) is None:
        # not rendered by us (made by hand, or from before the hash): no step to read
        return with_start(desired, start)
    own, partner = rollout.budget(role), rollout.budget("decode" if role == "prefill" else "prefill")
    live_replicas = actual.get("spec", {}).get("replicas")  # 0 while a role of one slides past its pod
    replicas, last = int(n if live_replicas is None else live_replicas), step_at(actual) or now
    held = with_steps(desired, start, replicas, partition_of(actual), last)

    def moved(to_start: int, to_replicas: int, to_partition: int) -> dict[str, Any]:
        same = (to_start, to_replicas, to_partition) == (start, replicas, partition_of(actual))
        return held if same else with_steps(desired, to_start, to_replicas, to_partition, now)

    if _annotation(actual, TEMPLATE_HASH) != _annotation(desired, TEMPLATE_HASH):
        if rollout.paused:  # the template is kept, and no pod takes it yet
            return with_steps(desired, start, replicas, max(partition_of(actual), replicas), None)
        if (under_way(actual, n) or partition_of(actual) > 0) and not overdue(actual, rollout, now):
            # A change while a rollout runs waits for it: restarting from the mixed pods would take
            # the newest ready ones down at once. A failed rollout is not waited for.
            in_flight = _with_template_of(actual, desired)
            return step(
                in_flight,
                actual,
                pods,
                partner_pods,
                rollout,
                now,
                partner_progress,
                role=role,
                settle=settle,
            )
        return with_steps(desired, start, _window(n, n, own), n, now)  # a new rollout: its clock starts now
    status = actual.get("status", {})
    if not observed(actual):
        return held  # its controller has not acted on the last step yet
    moving, update = rolling(actual), status.get("updateRevision")
    if rollout.paused and (moving or partition_of(actual) > 0 or replicas > n):
        return with_steps(desired, start, replicas, partition_of(actual), None)
    # Where each pod sits in the window (pods outside it are going).
    ready = {place for pod in pods if settled(pod, now, settle) and (place := _place(pod, start)) is not None}
    # Pods that left the window hold what they ran on (a GPU) until they have drained: the window
    # grows into their places only as they go, so the role never holds more than n + maxSurge pods
    # (one stuck past its grace period, on a lost node, is not waited for).
    draining = sum(
        1
        for pod in pods
        if (o := ordinal_of(pod)) is not None
        and not start <= o < start + replicas
        and holds_resources(pod, now)
    )

    def grown(to: int) -> int:
        return to if to <= replicas else max(replicas, min(to, n + own.surge - draining))

    if not moving:  # every pod is at the template: any pods past the replicas go, once the others serve
        return moved(start, grown(n), 0) if replicas <= n or all(p in ready for p in range(n)) else held
    # Scaled down mid-rollout: old pods past the new count are rolled as new ones.
    old = min(partition_of(actual), n)
    total = grown(_window(n, old, own))
    if total > replicas:
        return moved(start, total, old)  # the last step's second half: no wait to fail a deadline on
    if overdue(actual, rollout, now):
        return held  # failed: stopped where it is until the template changes
    fresh = {
        place
        for pod in pods
        if pod.get("metadata", {}).get("labels", {}).get(REVISION_LABEL) == update
        and (place := _place(pod, start)) in ready
    }
    if old == 0:  # no old pod left; pods past the replicas (a rollout made before the window moved) go
        serving = all(p in fresh for p in range(n))  # once the ones that stay serve
        return moved(start, total, 0) if replicas <= n or serving else held
    if not all(p in fresh for p in range(old, total)):
        return moved(start, total, old)  # the last step's pods are not all up yet
    fingerprint = desired["spec"]["template"]["metadata"]["labels"].get(labels.KV_FINGERPRINT)
    # With neither role surging, no pair of the new fingerprint can come first: prefill takes its first
    # step alone, then waits like decode.
    leads = role == "prefill" and own.surge == 0 and partner.surge == 0 and old >= n
    if not (fingerprint is None or leads or fingerprint in ready_fingerprints(partner_pods, now, settle)):
        return moved(start, total, old)  # old pods go only once a new pair can serve
    old_ready = [p in ready for p in range(old)]  # the lowest first: the order they go in
    taken = _replaceable(n, old_ready, total - old, own, partner_progress, rollout)
    # The top of the window stays: the StatefulSet creates a new ordinal before it deletes one left
    # below the window, so the new pods that take the old ones' places come at the next step, once
    # the old ones are going.
    return moved(start + taken, replicas - taken, old - taken)


def _place(pod: dict[str, Any], start: int) -> int | None:
    """The pod's place in its StatefulSet's window (0 for its first ordinal)."""
    ordinal = ordinal_of(pod)
    return None if ordinal is None or ordinal < start else ordinal - start


def _window(n: int, old: int, own: RoleBudget) -> int:
    """The replicas while `old` old pods remain: as many new ones as the surge allows, up to n."""
    return old + min(n, n + own.surge - old)


def _replaceable(
    n: int,
    old_ready: list[bool],
    new: int,
    own: RoleBudget,
    partner_progress: float,
    rollout: RolloutSpec,
) -> int:
    """How many old pods, the lowest first, may go at once (each new pod above them ready): the role
    keeps at least n - maxUnavailable ready pods (an old pod not ready costs nothing to replace), and
    its share of old pods replaced stays within maxSkew of the other role's, unless it is not ahead
    now (then one)."""
    old = len(old_ready)
    available = new + sum(old_ready)
    level = _replaced(n, old) <= partner_progress
    taken = 0
    for is_ready in old_ready:
        cost = 1 if is_ready else 0
        left = old - taken - 1
        in_step = _replaced(n, left) - partner_progress <= rollout.max_skew / 100 or (level and not taken)
        if available - cost < n - own.unavailable or not in_step:
            break
        available -= cost
        taken += 1
    return taken


def replicas_without_surge(sts: dict[str, Any], surge: int) -> int:
    """The role's own replicas, read from a StatefulSet mid-rollout: the count its last step stamped,
    else (stamped by an operator from before the stamp) its replicas less the surge while old pods
    remain (none before the first step, where replicas equals the partition)."""
    stamped = _annotation(sts, ROLE_REPLICAS)
    if stamped is not None and stamped.isdigit():
        return int(stamped)
    replicas, old = int(sts.get("spec", {}).get("replicas") or 0), partition_of(sts)
    return replicas - min(surge, old) if replicas > old else replicas
