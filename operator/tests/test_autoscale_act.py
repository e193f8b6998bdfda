"""Active autoscaling's steps (autoscale/act.py, autoscale/applied.py), no cluster: one replica per step
toward the recommendation, none while a rollout is under way or before the last step's pods are
measured, bounds at once; the count is rendered into the role's StatefulSet and read back from it by a
restarted operator; a resource that leaves active mode gives the count back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from dllm_cases import minimal

from dllm_operator.api import parse
from dllm_operator.api.rollout import EngineRole
from dllm_operator.autoscale.act import (
    Step,
    initial_replicas,
    kept_measured,
    measured,
    next_replicas,
    with_applied,
)
from dllm_operator.autoscale.applied import AppliedReplicas
from dllm_operator.autoscale.decide import Decision, Recommendation
from dllm_operator.config import OperatorConfig
from dllm_operator.render import render_all
from dllm_operator.render.engine import AUTOSCALED_REPLICAS as APPLIED
from dllm_operator.render.engine import TEMPLATE_HASH

NOW = 1_800_000_000.0
PREFILL = {"minReplicas": 1, "maxReplicas": 4, "target": {"queuedPromptTokensPerReplica": 4096}}
DECODE = {"minReplicas": 1, "maxReplicas": 3, "target": {"kvCacheUsage": 0.7}}


def active_cr(mode: str = "active", **autoscaling: Any) -> Any:
    body = minimal("scaled")
    body["metadata"]["uid"] = "u1"
    body["spec"]["autoscaling"] = {"mode": mode, "prefill": PREFILL, "decode": DECODE} | autoscaling
    return parse(body)


def pod(name: str, ready_for: float | None) -> dict[str, Any]:
    """A pod Ready for `ready_for` seconds before NOW (None: not ready)."""
    since = datetime.fromtimestamp(NOW - (ready_for or 0), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = "True" if ready_for is not None else "False"
    return {
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": since}]},
    }


def statefulsets(cr: Any) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in render_all(cr, OperatorConfig()) if o["kind"] == "StatefulSet"}


@pytest.mark.parametrize(
    ("applied", "recommended", "is_measured", "kept", "rolling", "expected"),
    [
        (1, 4, True, True, False, Step(2, "scaled 1 to 2, one step toward 4")),  # one replica, not three
        (3, 1, True, True, False, Step(2, "scaled 3 to 2, one step toward 1")),
        (2, 2, True, True, False, Step(2, "")),
        (1, 3, True, True, True, Step(1, "held at 1 (recommended 3): a rollout is under way")),
        (
            1,
            3,
            False,
            True,
            False,
            Step(1, "held at 1 (recommended 3): the last step's pods are not measured yet"),
        ),
        # down: only the pods it keeps need to be measured (the one it removes may never have started)
        (3, 2, False, True, False, Step(2, "scaled 3 to 2, one step toward 2")),
        (
            3,
            2,
            True,
            False,
            False,
            Step(3, "held at 3 (recommended 2): the last step's pods are not measured yet"),
        ),
        (2, 9, True, True, False, Step(3, "scaled 2 to 3, one step toward 4")),  # the recommendation bounded
        (
            6,
            6,
            False,
            False,
            True,
            Step(4, "scaled 6 to 4: the bounds are 1..4"),
        ),  # bounds at once, rolling too
        (0, 1, False, False, False, Step(1, "scaled 0 to 1: the bounds are 1..4")),
    ],
)
def test_a_step_moves_one_replica_toward_the_recommendation_when_it_may(
    applied: int, recommended: int, is_measured: bool, kept: bool, rolling: bool, expected: Step
) -> None:
    step = next_replicas(
        applied, recommended, 1, 4, measured=is_measured, rolling=rolling, kept_measured=kept
    )
    assert step == expected


def test_a_role_is_measured_only_when_each_of_its_pods_has_been_ready_long_enough() -> None:
    # a step down to 1 needs only ordinal 0: the pod it removes may never have become ready
    assert kept_measured([pod("p-0", 60), pod("p-1", None)], 0, 1, NOW, 30)
    assert not kept_measured([pod("p-0", 10), pod("p-1", 60)], 0, 1, NOW, 30)
    # after a rollout the window starts higher: the lowest ordinal of it is the one kept
    assert kept_measured([pod("p-4", 60), pod("p-5", None)], 4, 1, NOW, 30)
    assert not kept_measured([pod("p-4", 10), pod("p-5", 60)], 4, 1, NOW, 30)
    assert measured([pod("p-0", 60), pod("p-1", 30)], 2, NOW, 30)
    assert not measured([pod("p-0", 60), pod("p-1", 29)], 2, NOW, 30)  # the new pod too recent
    assert not measured([pod("p-0", 60), pod("p-1", None)], 2, NOW, 30)  # not ready
    assert not measured([pod("p-0", 60)], 2, NOW, 30)  # the step's pod not created yet
    assert not measured([pod("p-0", 60), pod("p-1", 60)], 1, NOW, 30)  # a scaled-down pod still there


def test_the_count_is_rendered_into_the_statefulset_and_read_back_from_it() -> None:
    cr = active_cr()
    rendered = statefulsets(with_applied(cr, {"prefill": 3}))
    sts = rendered["scaled-prefill"]
    assert sts["spec"]["replicas"] == 3
    assert sts["metadata"]["annotations"][APPLIED] == "3"
    assert "replicas" not in rendered["scaled-decode"]["spec"]  # no count given: not rendered
    assert initial_replicas(cr.spec.autoscaling, "prefill", sts, cr.spec.rollout) == 3
    # mid-surge the StatefulSet runs more than the count: the record, not its replicas, is read back
    surged = {**sts, "spec": {**sts["spec"], "replicas": 4}}
    assert initial_replicas(cr.spec.autoscaling, "prefill", surged, cr.spec.rollout) == 3
    # a resource switched to active mode starts from the StatefulSet's replicas, within the bounds
    assert initial_replicas(cr.spec.autoscaling, "decode", {"spec": {"replicas": 2}}, cr.spec.rollout) == 2
    assert initial_replicas(cr.spec.autoscaling, "decode", {"spec": {"replicas": 7}}, cr.spec.rollout) == 3
    assert initial_replicas(cr.spec.autoscaling, "decode", None, cr.spec.rollout) == 1
    # switched to active mid-surge (no record yet): the replicas less the rollout's surge
    surging = active_cr(mode="active")
    surging_rollout = surging.spec.rollout.model_copy(update={"max_surge": 1})
    rolling = {"currentRevision": "a", "updateRevision": "b"}
    for replicas, partition in ((3, 2), (3, 1), (2, 0)):  # the surge pod up; one old pod left; none left
        mid = {"spec": {"replicas": replicas, "updateStrategy": _partition(partition)}, "status": rolling}
        assert initial_replicas(surging.spec.autoscaling, "decode", mid, surging_rollout) == 2, mid
    paused_first = {"spec": {"replicas": 2, "updateStrategy": _partition(2)}, "status": rolling}
    assert initial_replicas(surging.spec.autoscaling, "decode", paused_first, surging_rollout) == 2
    # the template is the same whatever the count (a step is a scale, never a rollout)
    again = statefulsets(with_applied(cr, {"prefill": 1}))
    assert (
        again["scaled-prefill"]["metadata"]["annotations"][TEMPLATE_HASH]
        == sts["metadata"]["annotations"][TEMPLATE_HASH]
    )


def _partition(partition: int) -> dict[str, Any]:
    return {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}


def test_advisory_mode_renders_no_count() -> None:
    cr = active_cr(mode="advisory")
    assert cr.spec.autoscaling.active_roles() == ()
    sts = statefulsets(cr)["scaled-prefill"]
    assert "replicas" not in sts["spec"]
    assert APPLIED not in sts["metadata"]["annotations"]


def decision(prefill: int, decode: int) -> Decision:
    return Decision(
        {
            "prefill": Recommendation(prefill, 0, "queued prompt tokens", 9000.0, "r"),
            "decode": Recommendation(decode, 0, "KV-cache usage", 0.5, "r"),
        }
    )


def sts(replicas: int, rolling: bool = False, observed: bool = True) -> dict[str, Any]:
    status = {"currentRevision": "a", "updateRevision": "b" if rolling else "a", "observedGeneration": 2}
    generation = 2 if observed else 3  # 3: a spec its controller has not acted on yet
    return {
        "metadata": {"name": "x", "generation": generation},
        "spec": {"replicas": replicas},
        "status": status,
    }


def test_the_leaders_record_steps_each_role_and_says_why_one_waits() -> None:
    cr, applied = active_cr(), AppliedReplicas()
    workloads = {"prefill": sts(1), "decode": sts(1)}
    assert applied.counts("k", cr, workloads) == {"prefill": 1, "decode": 1}
    pods: dict[str, list[dict[str, Any]]] = {"prefill": [pod("p-0", 600)], "decode": [pod("d-0", 600)]}
    moved = applied.step("k", cr, decision(3, 1), pods, workloads, NOW, 30)
    assert [(m.role, m.before, m.after) for m in moved] == [("prefill", 1, 2)]
    assert applied.counts("k", cr, workloads)["prefill"] == 2
    # the step's pod is not ready yet: held, and status says so
    pods["prefill"].append(pod("p-1", None))
    assert applied.step("k", cr, decision(3, 1), pods, workloads, NOW, 30) == []
    assert "not measured yet" in applied.actions("k")["prefill"]
    assert applied.actions("k")["decode"] == ""
    # ready and measured, but a rollout is under way on decode: no role steps
    pods["prefill"][1] = pod("p-1", 31)
    rolling = {"prefill": sts(2), "decode": sts(1, rolling=True)}
    assert applied.step("k", cr, decision(3, 1), pods, rolling, NOW, 30) == []
    assert "rollout" in applied.actions("k")["prefill"]
    # a spec just applied that the StatefulSet controller has not acted on (a rollout may be starting)
    unseen = {"prefill": sts(2), "decode": sts(1, observed=False)}
    assert applied.step("k", cr, decision(3, 1), pods, unseen, NOW, 30) == []
    moved = applied.step("k", cr, decision(3, 1), pods, {"prefill": sts(2), "decode": sts(1)}, NOW, 30)
    assert [(m.role, m.before, m.after) for m in moved] == [("prefill", 2, 3)]
    # advisory again: the counts and what status said of them go
    assert applied.counts("k", active_cr(mode="advisory"), workloads) == {}
    assert applied.actions("k") == {}


def test_a_surge_above_the_count_is_a_rollout_under_way() -> None:
    cr, applied = active_cr(), AppliedReplicas()
    applied.counts("k", cr, {"prefill": sts(2), "decode": sts(1)})
    pods = {"prefill": [pod("p-0", 600), pod("p-1", 600)], "decode": [pod("d-0", 600)]}
    surging = {"prefill": sts(2), "decode": sts(2)}  # decode's surge pod still there after its roll
    assert applied.step("k", cr, decision(3, 1), pods, surging, NOW, 30) == []


def test_leaving_active_mode_drops_the_count_and_bounds_changes_apply_at_once() -> None:
    applied = AppliedReplicas()
    roles: dict[EngineRole, int] = {"prefill": 4, "decode": 1}
    workloads: dict[str, dict[str, Any]] = {role: sts(n) for role, n in roles.items()}
    assert applied.counts("k", active_cr(), workloads) == roles
    narrower = active_cr(prefill={**PREFILL, "maxReplicas": 2})
    assert applied.counts("k", narrower, workloads)["prefill"] == 2
    assert applied.counts("k", active_cr(mode="advisory"), workloads) == {}
    rendered = render_all(with_applied(active_cr(mode="advisory"), {}), OperatorConfig())
    assert all("replicas" not in o["spec"] for o in rendered if o["kind"] == "StatefulSet")
