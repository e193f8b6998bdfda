"""The surge rollout's steps (rollout.py), one reconcile at a time, from what the cluster shows: the new
pods first, above the old; an old pod goes (the window of ordinals moves up past it) only once
everything above the partition is new and ready and the other role has a ready pod of the new
fingerprint; the new pods are the ones that stay. Pause, an autoscaled role and maxSurge 0 leave the
StatefulSet's own rolling update alone, and nothing moves the window back."""

from __future__ import annotations

import copy
import time
from typing import Any

from dllm_cases import merged, minimal

from dllm_operator import rollout
from dllm_operator.api import parse
from dllm_operator.api.rollout import EngineRole, RolloutSpec
from dllm_operator.render import labels
from dllm_operator.render.engine import TEMPLATE_HASH
from dllm_operator.rollout import STEP_AT, partition_of, progress, start_of
from dllm_operator.status import Observed, conditions, rollout_condition

SURGE = RolloutSpec(max_surge=1)
NOW = 2_000_000_000.0
OLD_FP, NEW_FP = "0ld", "1ew"


def step(*args: Any, role: EngineRole = "prefill", **kwargs: Any) -> dict[str, Any]:
    """rollout.step, for prefill (the StatefulSets here are x-prefill's) unless told otherwise."""
    return rollout.step(*args, role=role, **kwargs)


def sts(replicas: int | None, template: str, fingerprint: str = NEW_FP) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {"metadata": {"labels": {labels.KV_FINGERPRINT: fingerprint}}},
        "updateStrategy": {"type": "RollingUpdate"},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "kind": "StatefulSet",
        "metadata": {"name": "x-prefill", "annotations": {TEMPLATE_HASH: template}, "generation": 3},
        "spec": spec,
    }


def live(
    template: str,
    replicas: int,
    partition: int,
    current: str,
    update: str,
    observed: int = 3,
    stepped: float = NOW - 60,
    start: int = 0,
) -> dict[str, Any]:
    """The StatefulSet as the API server shows it, its window from `start`, its last step `stepped`."""
    obj = sts(replicas, template)
    if start:
        obj["spec"]["ordinals"] = {"start": start}
    obj["metadata"]["annotations"][STEP_AT] = f"{stepped:.0f}"
    obj["spec"]["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}
    obj["status"] = {"observedGeneration": observed, "currentRevision": current, "updateRevision": update}
    return obj


def pod(ordinal: int, revision: str, ready: bool = True, fingerprint: str = NEW_FP) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"x-prefill-{ordinal}",
            "labels": {"controller-revision-hash": revision, labels.KV_FINGERPRINT: fingerprint},
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


PARTNER_NEW = [pod(0, "d-old", fingerprint=OLD_FP), pod(1, "d-new")]  # decode: its surge pod ready
PARTNER_OLD = [pod(0, "d-old", fingerprint=OLD_FP)]


def at(result: dict[str, Any]) -> tuple[int, int, int]:
    """Where the step leaves the StatefulSet: its window's start, its replicas, its partition."""
    return start_of(result), result["spec"]["replicas"], partition_of(result)


def test_a_template_change_starts_with_the_surge_pods_only() -> None:
    result = step(
        sts(2, "t2"), live("t1", 2, 0, "r1", "r1"), [pod(0, "r1"), pod(1, "r1")], PARTNER_OLD, SURGE, NOW
    )
    assert at(result) == (0, 3, 2)


def test_an_old_pod_goes_only_when_all_above_the_partition_is_new_and_ready_and_the_partner_paired() -> None:
    actual = live("t2", 3, 2, "r1", "r2")
    ready_surge = [pod(0, "r1"), pod(1, "r1"), pod(2, "r2")]
    # ordinal 0 goes; once it has drained, a new pod is added above the surge one (2 + maxSurge 1 pods)
    assert at(step(sts(2, "t2"), actual, ready_surge, PARTNER_NEW, SURGE, NOW)) == (1, 2, 1)
    going = live("t2", 2, 1, "r1", "r2", start=1)
    draining = [
        {**ready_surge[0], "metadata": {**ready_surge[0]["metadata"], "deletionTimestamp": _at(NOW + 30)}}
    ]
    assert at(step(sts(2, "t2"), going, draining + ready_surge[1:], PARTNER_NEW, SURGE, NOW)) == (1, 2, 1)
    # past its grace period and still there: its node is gone, and it is not waited for
    assert at(step(sts(2, "t2"), going, draining + ready_surge[1:], PARTNER_NEW, SURGE, NOW + 31)) == (
        1,
        3,
        1,
    )
    assert at(step(sts(2, "t2"), going, ready_surge[1:], PARTNER_NEW, SURGE, NOW)) == (1, 3, 1)  # gone
    # the surge pod not ready yet: hold
    starting = [pod(0, "r1"), pod(1, "r1"), pod(2, "r2", ready=False)]
    assert at(step(sts(2, "t2"), actual, starting, PARTNER_NEW, SURGE, NOW)) == (0, 3, 2)
    # the other role has no ready pod of the new fingerprint: hold, old pairs keep serving
    assert at(step(sts(2, "t2"), actual, ready_surge, PARTNER_OLD, SURGE, NOW)) == (0, 3, 2)


def test_the_window_moves_up_past_the_old_pods_and_ends_at_the_replicas() -> None:
    actual = live("t2", 3, 1, "r1", "r2", start=1)
    pods = [pod(1, "r1"), pod(2, "r2"), pod(3, "r2")]
    assert at(step(sts(2, "t2"), actual, pods, PARTNER_NEW, SURGE, NOW)) == (2, 2, 0)  # 2 and 3 stay
    done = live("t2", 2, 0, "r2", "r2", start=2)  # every pod new and ready: the controller says so
    pods = [pod(2, "r2"), pod(3, "r2")]
    assert at(step(sts(2, "t2"), done, pods, PARTNER_NEW, SURGE, NOW)) == (2, 2, 0)


def test_a_role_of_one_starts_one_new_pod_and_it_stays() -> None:
    """One replica, maxSurge 1: the new pod comes up beside the old one, then the old one goes; the new
    pod is never replaced again (the surge pod is the one that stays: one model load, not two)."""
    first = step(sts(1, "t2"), live("t1", 1, 0, "r1", "r1"), [pod(0, "r1")], PARTNER_OLD, SURGE, NOW)
    assert at(first) == (0, 2, 1)
    both = [pod(0, "r1"), pod(1, "r2")]
    assert at(step(sts(1, "t2"), live("t2", 2, 1, "r1", "r2"), both, PARTNER_NEW, SURGE, NOW)) == (1, 1, 0)
    done = live("t2", 1, 0, "r2", "r2", start=1)
    assert at(step(sts(1, "t2"), done, [pod(1, "r2")], PARTNER_NEW, SURGE, NOW)) == (1, 1, 0)


def test_a_surge_larger_than_the_role_adds_no_more_new_pods_than_its_replicas() -> None:
    wide = RolloutSpec(max_surge=3)
    first = step(sts(1, "t2"), live("t1", 1, 0, "r1", "r1"), [pod(0, "r1")], PARTNER_OLD, wide, NOW)
    assert at(first) == (0, 2, 1)


def test_a_step_the_controller_has_not_seen_is_held() -> None:
    actual = live("t2", 3, 2, "r1", "r2", observed=2)
    assert at(step(sts(2, "t2"), actual, [pod(2, "r2")], PARTNER_NEW, SURGE, NOW)) == (0, 3, 2)


def test_pause_holds_every_step() -> None:
    paused = RolloutSpec(max_surge=1, paused=True)
    before = live("t1", 2, 0, "r1", "r1")
    assert at(step(sts(2, "t2"), before, [], PARTNER_OLD, paused, NOW)) == (0, 2, 2)  # no pod takes it
    mid = live("t2", 3, 2, "r1", "r2")
    pods = [pod(0, "r1"), pod(1, "r1"), pod(2, "r2")]
    assert at(step(sts(2, "t2"), mid, pods, PARTNER_NEW, paused, NOW)) == (0, 3, 2)


def test_no_surge_an_autoscaled_role_or_a_new_statefulset_is_rendered_as_is() -> None:
    desired = sts(2, "t2")
    actual = live("t1", 2, 0, "r1", "r1")
    assert step(desired, actual, [], PARTNER_OLD, RolloutSpec(), NOW) is desired
    autoscaled = sts(None, "t2")
    assert step(autoscaled, actual, [], PARTNER_OLD, SURGE, NOW) is autoscaled
    assert step(desired, None, [], PARTNER_OLD, SURGE, NOW) is desired


def test_no_rendering_moves_the_window_back() -> None:
    """A role rolled before starts at a higher ordinal; rendered as is, the StatefulSet would start at
    0 again and replace every pod at once. Without coordination, for an autoscaled role, for one made by
    hand, and for one made again after an immutable field orphaned its pods, the window stays."""
    moved_up = live("t2", 2, 0, "r2", "r2", start=4)
    pods = [pod(4, "r2"), pod(5, "r2")]
    assert start_of(step(sts(2, "t3"), moved_up, pods, PARTNER_OLD, RolloutSpec(), NOW)) == 4
    assert start_of(step(sts(None, "t3"), moved_up, pods, PARTNER_OLD, SURGE, NOW)) == 4
    by_hand = copy.deepcopy(moved_up)
    del by_hand["metadata"]["annotations"][TEMPLATE_HASH]
    assert start_of(step(sts(2, "t3"), by_hand, pods, PARTNER_OLD, SURGE, NOW)) == 4
    assert start_of(step(sts(2, "t3"), None, pods, PARTNER_OLD, SURGE, NOW)) == 4  # orphaned pods
    assert at(step(sts(3, "t2"), moved_up, pods, PARTNER_OLD, SURGE, NOW)) == (4, 3, 0)  # scaled up


def test_a_settled_role_sets_partition_zero_and_its_replicas() -> None:
    actual = live("t2", 2, 0, "r2", "r2")
    assert at(step(sts(2, "t2"), actual, [pod(0, "r2"), pod(1, "r2")], PARTNER_NEW, SURGE, NOW)) == (0, 2, 0)
    scaled = copy.deepcopy(sts(4, "t2"))
    assert at(step(scaled, actual, [pod(0, "r2"), pod(1, "r2")], PARTNER_NEW, SURGE, NOW)) == (0, 4, 0)


def role_workload(name: str, replicas: int, current: str, update: str, updated: int) -> dict[str, Any]:
    obj = live("t2", replicas, 1, current, update)
    obj["metadata"]["name"] = name
    obj["status"]["updatedReplicas"] = updated
    return obj


def rollout_of(
    workloads: dict[str, dict[str, Any]], paused: bool = False, overdue: tuple[str, ...] = ()
) -> tuple[bool | None, str, str]:
    spec = {
        "rollout": {"maxSurge": 1, "paused": paused},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
    }
    cr = parse(merged(minimal("x"), {"spec": spec}))
    found = rollout_condition(cr, Observed(workloads=workloads, pods={}, rollouts_overdue=overdue))
    return found.status, found.reason, found.message


def test_rollout_progressing_says_which_role_moves_and_where() -> None:
    moving = {
        "prefill": role_workload("x-prefill", 2, "r1", "r2", 1),
        "decode": role_workload("x-decode", 1, "d", "d", 1),
    }
    status, reason, message = rollout_of(moving)
    assert (status, reason) == (True, "RollingOut")
    assert message == "x-prefill: 1/2 pods at the new template (partition 1)"
    assert rollout_of(moving, paused=True)[:2] == (False, "Paused")
    surge_left = {"prefill": role_workload("x-prefill", 2, "r2", "r2", 2)}  # 1 replica wanted
    assert rollout_of(surge_left) == (True, "RollingOut", "x-prefill: 1 surge pods to go")
    done = {
        "prefill": role_workload("x-prefill", 1, "r2", "r2", 1),
        "decode": role_workload("x-decode", 1, "d", "d", 1),
    }
    assert rollout_of(done)[:2] == (False, "Complete")


def test_a_step_is_stamped_and_a_rollout_without_one_past_its_deadline_stops() -> None:
    pods = [pod(0, "r1"), pod(1, "r1"), pod(2, "r2")]
    moved = step(sts(2, "t2"), live("t2", 3, 2, "r1", "r2"), pods, PARTNER_NEW, SURGE, NOW)
    assert at(moved) == (1, 2, 1)
    assert moved["metadata"]["annotations"][STEP_AT] == f"{NOW:.0f}"
    starting = [pod(0, "r1"), pod(1, "r1"), pod(2, "r2", ready=False)]
    held = step(sts(2, "t2"), live("t2", 3, 2, "r1", "r2"), starting, PARTNER_NEW, SURGE, NOW)
    assert held["metadata"]["annotations"][STEP_AT] == f"{NOW - 60:.0f}"  # no step: the clock runs on
    stale = live("t2", 3, 2, "r1", "r2", stepped=NOW - SURGE.progress_deadline_seconds - 1)
    assert at(step(sts(2, "t2"), stale, pods, PARTNER_NEW, SURGE, NOW)) == (0, 3, 2)  # failed: stopped


def test_a_paused_rollout_runs_no_clock() -> None:
    paused = RolloutSpec(max_surge=1, paused=True)
    mid = live("t2", 3, 2, "r1", "r2", stepped=NOW - 10_000)
    held = step(sts(2, "t2"), mid, [pod(2, "r2")], PARTNER_NEW, paused, NOW)
    assert held["metadata"]["annotations"][STEP_AT] == "paused"
    resumed = step(
        sts(2, "t2"),
        held | {"status": mid["status"]},
        [pod(0, "r1"), pod(1, "r1"), pod(2, "r2")],
        PARTNER_NEW,
        SURGE,
        NOW,
    )
    assert at(resumed) == (1, 2, 1)  # not overdue: the pause stopped its clock


def test_a_rollout_past_its_deadline_says_so_and_degrades_the_resource() -> None:
    moving = {"prefill": role_workload("x-prefill", 2, "r1", "r2", 0)}
    status, reason, message = rollout_of(moving, overdue=("x-prefill",))
    assert (status, reason) == (False, "ProgressDeadlineExceeded")
    assert message.startswith("x-prefill: no step in 1800s; stopped, the old pods serving")
    cr = parse(merged(minimal("x"), {"spec": {"rollout": {"maxSurge": 1}, "prefill": {"replicas": 2}}}))
    found = {c.type: c for c in conditions(cr, Observed(moving, {}, rollouts_overdue=("x-prefill",)))}
    assert (found["Degraded"].status, found["Degraded"].reason) == (True, "ProgressDeadlineExceeded")


def _roll_both(prefill: int, decode: int, spec: RolloutSpec) -> list[tuple[float, float]]:
    """Both roles stepped together, one reconcile after another, every new pod ready at once (the
    fastest case for the skew): each role's progress after each reconcile, until both are done."""
    n: dict[EngineRole, int] = {"prefill": prefill, "decode": decode}
    partition = dict(n)
    start = {role: 0 for role in n}
    replicas = {role: n[role] + 1 for role in n}
    seen: list[tuple[float, float]] = []
    pairs: tuple[tuple[EngineRole, EngineRole], ...] = (("prefill", "decode"), ("decode", "prefill"))
    for _ in range(4 * (prefill + decode)):
        actual = {
            role: live("t2", replicas[role], partition[role], "r1", "r2", start=start[role]) for role in n
        }
        progress_now = {role: progress(sts(n[role], "t2"), actual[role]) for role in n}
        for role, partner in pairs:
            first, old_end = start[role], start[role] + partition[role]
            pods = [pod(i, "r2" if i >= old_end else "r1") for i in range(first, first + replicas[role])]
            moved = step(
                sts(n[role], "t2"),
                actual[role],
                pods,
                PARTNER_NEW,
                spec,
                NOW,
                progress_now[partner],
                role=role,
            )
            start[role], replicas[role], partition[role] = at(moved)
        done = {role: (n[role] - partition[role]) / n[role] for role in n}
        seen.append((done["prefill"], done["decode"]))
        if partition == {"prefill": 0, "decode": 0}:
            return seen
    raise AssertionError(f"the rollout stopped moving: {seen}")


def test_max_skew_keeps_the_roles_in_step_and_never_deadlocks() -> None:
    for prefill, decode in ((1, 1), (2, 4), (4, 2), (3, 8)):
        for skew in (1, 25, 50, 100):
            seen = _roll_both(prefill, decode, RolloutSpec(max_surge=1, max_skew=skew))
            bound = max(skew / 100, 1 / min(prefill, decode))  # one pod's share of the smaller role
            worst = max(abs(p - d) for p, d in seen)
            assert worst <= bound + 1e-9, (prefill, decode, skew, seen)
    # the bound binds: unbounded, prefill of 2 is done in two steps while decode of 8 has taken two;
    # at 25% prefill waits after each step (one pod's share of 2) until decode is level again, then
    # steps while decode adds the new pods of its last step (a step of its own), so the skew is 1/2
    unbounded = _roll_both(2, 8, RolloutSpec(max_surge=1))
    bounded = _roll_both(2, 8, RolloutSpec(max_surge=1, max_skew=25))
    assert max(abs(p - d) for p, d in unbounded) == 1 - 2 / 8
    assert max(abs(p - d) for p, d in bounded) == 1 / 2
    assert len(bounded) == len(unbounded)  # holding the faster role back costs no time: decode sets the pace


def test_progress_is_the_share_of_old_pods_replaced() -> None:
    assert progress(sts(2, "t2"), None) == 1.0
    assert progress(sts(2, "t2"), live("t1", 2, 0, "r1", "r1")) == 0.0  # the template changed, no step yet
    assert progress(sts(4, "t2"), live("t2", 5, 3, "r1", "r2")) == 0.25
    assert progress(sts(4, "t2"), live("t2", 5, 0, "r2", "r2")) == 1.0  # every pod new


def test_a_change_while_a_rollout_runs_waits_for_it_then_rolls() -> None:
    """1/1 with one surge pod, mid-way: the old pod going (the window moved past it), the new one above
    it starting. A further change (or an undo) does not take the starting pod down: the rollout under
    way finishes at its template first, then the next starts. A failed (overdue) one is not waited for."""
    mid = live("t2", 1, 0, "r1", "r2", start=1)
    mid["spec"]["template"]["metadata"]["labels"]["revision-of"] = "t2"
    starting = [pod(0, "r1"), pod(1, "r2", ready=False)]
    held = step(sts(1, "t3"), mid, starting, PARTNER_NEW, SURGE, NOW)
    assert held["metadata"]["annotations"][TEMPLATE_HASH] == "t2"
    assert held["spec"]["template"]["metadata"]["labels"]["revision-of"] == "t2"
    assert at(held) == (1, 1, 0)
    done = live("t2", 1, 0, "r2", "r2", start=1)
    started = step(sts(1, "t3"), done, [pod(1, "r2")], PARTNER_NEW, SURGE, NOW)
    assert (started["metadata"]["annotations"][TEMPLATE_HASH], at(started)) == ("t3", (1, 2, 1))
    failed = live("t2", 2, 1, "r1", "r2", stepped=NOW - SURGE.progress_deadline_seconds - 1)
    undone = step(sts(1, "t1"), failed, [pod(0, "r1"), pod(1, "r2", ready=False)], PARTNER_OLD, SURGE, NOW)
    assert (undone["metadata"]["annotations"][TEMPLATE_HASH], at(undone)) == ("t1", (0, 2, 1))


def test_a_statefulset_without_the_operators_template_hash_is_not_taken_for_a_rollout() -> None:
    """One made by hand (or an impostor the operator replaces for an immutable field) has no hash: the
    rendering is applied as it is, with no surge pod for a change that may be none."""
    foreign = live("t1", 2, 0, "r1", "r1")
    del foreign["metadata"]["annotations"][TEMPLATE_HASH]
    desired = sts(2, "t2")
    assert step(desired, foreign, [pod(0, "r1"), pod(1, "r1")], PARTNER_OLD, SURGE, NOW) is desired


def _at(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def ready_at(ordinal: int, revision: str, since: float, fingerprint: str = NEW_FP) -> dict[str, Any]:
    made = pod(ordinal, revision, fingerprint=fingerprint)
    made["status"]["conditions"][0]["lastTransitionTime"] = _at(since)
    return made


def test_a_new_pod_serves_only_once_it_has_been_ready_long_enough_for_the_router_to_find_it() -> None:
    """The router finds pods by DNS and health checks every few seconds: a surge pod ready 5 s ago
    does not yet let an old pod go, nor does the partner's; after the settle time both do; and a pod
    past the replicas (scaled down) goes only once the pods that stay have settled too."""
    actual = live("t2", 3, 2, "r1", "r2")
    fresh = [pod(0, "r1"), pod(1, "r1"), ready_at(2, "r2", NOW - 5)]
    settled = [pod(0, "r1"), pod(1, "r1"), ready_at(2, "r2", NOW - 20)]
    partner_fresh = [pod(0, "d-old", fingerprint=OLD_FP), ready_at(1, "d-new", NOW - 5)]
    assert at(step(sts(2, "t2"), actual, fresh, PARTNER_NEW, SURGE, NOW, settle=15)) == (0, 3, 2)
    assert at(step(sts(2, "t2"), actual, settled, partner_fresh, SURGE, NOW, settle=15)) == (0, 3, 2)
    assert at(step(sts(2, "t2"), actual, settled, PARTNER_NEW, SURGE, NOW, settle=15)) == (1, 2, 1)
    done = live("t2", 3, 0, "r2", "r2")
    just_replaced = [ready_at(0, "r2", NOW - 20), ready_at(1, "r2", NOW - 3), ready_at(2, "r2", NOW - 60)]
    assert at(step(sts(2, "t2"), done, just_replaced, PARTNER_NEW, SURGE, NOW, settle=15)) == (0, 3, 0)
    later = [ready_at(0, "r2", NOW - 20), ready_at(1, "r2", NOW - 16), ready_at(2, "r2", NOW - 60)]
    assert at(step(sts(2, "t2"), done, later, PARTNER_NEW, SURGE, NOW, settle=15)) == (0, 2, 0)


def test_a_rollout_an_earlier_operator_began_keeps_its_surge_until_the_pods_made_again_serve() -> None:
    """An operator from before the window moved re-created ordinals 0..N-1 in place and took the surge
    away at the end: met mid-way (partition 0, the surge pod serving, ordinal 0 loading), the surge
    stays until ordinal 0 serves, as before."""
    legacy = live("t2", 2, 0, "r1", "r2")
    loading = [pod(0, "r2", ready=False), pod(1, "r2")]
    assert at(step(sts(1, "t2"), legacy, loading, PARTNER_NEW, SURGE, NOW)) == (0, 2, 0)
    serving = [pod(0, "r2"), pod(1, "r2")]
    assert at(step(sts(1, "t2"), legacy, serving, PARTNER_NEW, SURGE, NOW)) == (0, 1, 0)


def test_the_new_pods_of_a_step_are_added_even_past_the_deadline() -> None:
    """The old pods went and the operator was away longer than progressDeadlineSeconds (a leader
    handover): adding their replacements is the rest of the step already taken, not a new one the
    deadline may stop."""
    stale = live("t2", 2, 1, "r1", "r2", start=1, stepped=NOW - SURGE.progress_deadline_seconds - 1)
    pods = [pod(1, "r1"), pod(2, "r2")]
    assert at(step(sts(2, "t2"), stale, pods, PARTNER_NEW, SURGE, NOW)) == (1, 3, 1)


def test_the_roles_own_replicas_are_read_back_from_the_step_not_the_window() -> None:
    """After a step that let old pods go and before their replacements come, the window holds fewer
    pods than the role's replicas: the stamp says what the role has."""
    pods = [pod(o, "r1") for o in range(4)] + [pod(4, "r2")]
    moved = step(sts(4, "t2"), live("t2", 5, 4, "r1", "r2"), pods, PARTNER_NEW, SURGE, NOW)
    assert at(moved) == (1, 4, 3)
    assert rollout.replicas_without_surge(moved, SURGE.max_surge) == 4
    unstamped = live("t2", 5, 4, "r1", "r2")  # an earlier operator's step: read from the window
    assert rollout.replicas_without_surge(unstamped, SURGE.max_surge) == 4


def test_a_statefulset_made_again_starts_at_its_lowest_pod_that_is_not_going() -> None:
    """Deleted for an immutable field, its pods orphaned, right after a rollout: the pods below the
    window still drain. The one made again starts at the pods that serve, not at the draining ones
    (it would delete the serving ones as out of its window)."""
    draining = [
        {**pod(o, "r1"), "metadata": {**pod(o, "r1")["metadata"], "deletionTimestamp": "t"}} for o in (0, 1)
    ]
    serving = [pod(2, "r2"), pod(3, "r2")]
    assert start_of(step(sts(2, "t3"), None, draining + serving, PARTNER_NEW, SURGE, NOW)) == 2
