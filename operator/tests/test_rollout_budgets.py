"""Coordinated rollouts under per-role maxSurge and maxUnavailable (rollout.py), simulated one reconcile
at a time: a pod the StatefulSet creates is ready at the next reconcile. At every moment each role
keeps replicas - maxUnavailable ready pods and runs at most replicas + maxSurge, a complete pair of one
fingerprint serves wherever one can, the roles keep within maxSkew, and the rollout ends having made
each role's new pods once (no pod started twice, as replacing in place after a surge did)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from test_rollout_steps import NEW_FP, OLD_FP, live, pod, sts

from dllm_operator import rollout
from dllm_operator.api.rollout import EngineRole, RolloutSpec
from dllm_operator.rollout import partition_of, progress, start_of

ROLES: tuple[EngineRole, EngineRole] = ("prefill", "decode")
ROLE_PAIRS: tuple[tuple[EngineRole, EngineRole], ...] = (("prefill", "decode"), ("decode", "prefill"))


@dataclass
class Role:
    """One role's StatefulSet as the simulated cluster holds it: ordinal -> (revision, round created)."""

    n: int
    replicas: int = 0
    partition: int = 0
    start: int = 0
    template: str = "t1"
    pods: dict[int, tuple[str, int]] = field(default_factory=dict)
    going: dict[int, tuple[str, int]] = field(default_factory=dict)  # revision, round it left the window
    made: int = 0  # pods created since the template changed

    def __post_init__(self) -> None:
        self.replicas = self.n
        self.pods = {ordinal: ("r1", -1) for ordinal in range(self.n)}

    def live(self) -> dict[str, Any]:
        old = any(revision == "r1" for revision, _ in self.pods.values())
        update = "r2" if self.template == "t2" else "r1"  # the revision of the template it holds
        current = "r1" if old else "r2"
        return live(self.template, self.replicas, self.partition, current, update, start=self.start)

    def pod_list(self, now: int) -> list[dict[str, Any]]:
        listed = [
            pod(o, revision, ready=born < now, fingerprint=NEW_FP if revision == "r2" else OLD_FP)
            for o, (revision, born) in sorted(self.pods.items())
        ]
        for o, (revision, _) in sorted(self.going.items()):
            draining = pod(o, revision, ready=False, fingerprint=NEW_FP if revision == "r2" else OLD_FP)
            draining["metadata"]["deletionTimestamp"] = "2100-01-01T00:00:00Z"  # in its grace period
            listed.append(draining)
        return listed

    def ready(self, now: int) -> set[str]:
        return {"new" if revision == "r2" else "old" for revision, born in self.pods.values() if born < now}

    def ready_count(self, now: int) -> int:
        return sum(1 for _, born in self.pods.values() if born < now)

    def apply(self, result: dict[str, Any], now: int) -> None:
        """What the StatefulSet controller does with the step: ordinals outside the window go, ordinals
        from the partition up (it counts from the window's start) that are old or missing are created
        from the new template."""
        self.template, self.replicas, self.partition = "t2", result["spec"]["replicas"], partition_of(result)
        self.start = start_of(result)
        window = range(self.start, self.start + self.replicas)
        # A pod that left the window drains for the next round too, then is gone.
        self.going = {o: (revision, left) for o, (revision, left) in self.going.items() if left >= now - 1}
        self.going |= {o: (revision, now) for o, (revision, _) in self.pods.items() if o not in window}
        self.pods = {o: p for o, p in self.pods.items() if o in window}
        for ordinal in window:
            if ordinal >= self.start + self.partition and self.pods.get(ordinal, ("r1",))[0] == "r1":
                self.pods[ordinal] = ("r2", now)
                self.made += 1


def roll(prefill: int, decode: int, spec: RolloutSpec) -> list[dict[str, Any]]:
    """Every reconcile's view after its steps, until both roles are new and settled."""
    roles = {"prefill": Role(prefill), "decode": Role(decode)}
    seen: list[dict[str, Any]] = []
    for now in range(8 * (prefill + decode) + 8):
        actual = {r: roles[r].live() for r in ROLES}
        done = {r: progress(sts(roles[r].n, "t2"), actual[r]) for r in ROLES}
        pods = {r: roles[r].pod_list(now) for r in ROLES}
        for r, partner in ROLE_PAIRS:
            moved = rollout.step(
                sts(roles[r].n, "t2"), actual[r], pods[r], pods[partner], spec, 1e9, done[partner], role=r
            )
            roles[r].apply(moved, now)
        seen.append(
            {
                "ready": {r: roles[r].ready_count(now) for r in ROLES},
                "pods": {r: len(roles[r].pods) + len(roles[r].going) for r in ROLES},  # draining too
                "pairs": roles["prefill"].ready(now) & roles["decode"].ready(now),
                "done": {r: (roles[r].n - min(roles[r].partition, roles[r].n)) / roles[r].n for r in ROLES},
                "made": {r: roles[r].made for r in ROLES},
            }
        )
        settled = all(
            roles[r].replicas == roles[r].n and all(rev == "r2" for rev, _ in roles[r].pods.values())
            for r in ROLES
        )
        if settled:
            return seen
    raise AssertionError(f"the rollout stopped moving: {seen[-3:]}")


BUDGETS: list[tuple[str, dict[str, Any]]] = [
    ("surge-1", {"maxSurge": 1}),
    ("surge-2", {"maxSurge": 2}),
    ("surge-1-unavailable-1", {"maxSurge": 1, "maxUnavailable": 1}),
    ("unavailable-1", {"maxUnavailable": 1}),
    ("prefill-surges-decode-not", {"prefill": {"maxSurge": 1}}),
    ("decode-surges-prefill-unavailable", {"decode": {"maxSurge": 2}, "prefill": {"maxUnavailable": 2}}),
    ("surge-1-skew-25", {"maxSurge": 1, "maxSkew": 25}),
]


@pytest.mark.parametrize(("case", "asked"), BUDGETS, ids=[b[0] for b in BUDGETS])
@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 4), (4, 2)])
def test_each_role_stays_within_its_budget_and_a_pair_serves_where_one_can(
    case: str, asked: dict[str, Any], prefill: int, decode: int
) -> None:
    spec = RolloutSpec.model_validate(asked)
    n = {"prefill": prefill, "decode": decode}
    budget = {r: spec.budget(r) for r in ROLES}
    seen = roll(prefill, decode, spec)
    for moment in seen:
        for r in ROLES:
            assert moment["ready"][r] >= n[r] - budget[r].unavailable, (case, r, moment)
            assert moment["pods"][r] <= n[r] + budget[r].surge, (case, r, moment)
    # A pair can always serve unless a role may lose all its pods at once.
    keeps_a_pair = all(n[r] > budget[r].unavailable for r in ROLES)
    if keeps_a_pair:
        assert all(moment["pairs"] for moment in seen), (case, seen)
    assert seen[-1]["made"] == n, (case, seen[-1])  # each new pod made once: one model load per pod
    skew = spec.max_skew / 100
    step_share = max(budget[r].surge + budget[r].unavailable for r in ROLES) / min(prefill, decode)
    assert all(abs(m["done"]["prefill"] - m["done"]["decode"]) <= max(skew, step_share) + 1e-9 for m in seen)


def test_unavailability_replaces_several_pods_at_once_and_finishes_sooner() -> None:
    one = roll(4, 4, RolloutSpec(max_surge=1))
    wide = roll(4, 4, RolloutSpec(max_surge=1, max_unavailable=1))
    assert len(wide) < len(one)
    assert min(m["ready"]["decode"] for m in wide) == 3  # one below its replicas, never two


def test_a_role_without_surge_or_unavailability_replaces_one_pod_at_a_time() -> None:
    spec = RolloutSpec.model_validate({"prefill": {"maxSurge": 1}})
    assert spec.coordinated
    assert (spec.budget("prefill"), spec.budget("decode")) == ((1, 0), (0, 1))
    seen = roll(2, 4, spec)
    assert min(m["ready"]["decode"] for m in seen) == 3
    assert max(m["pods"]["decode"] for m in seen) == 4


def test_all_zero_leaves_the_statefulsets_own_rolling_update() -> None:
    spec = RolloutSpec.model_validate({"prefill": {"maxSurge": 0}, "decode": {"maxUnavailable": 0}})
    assert not spec.coordinated
    desired = sts(2, "t2")
    assert rollout.step(desired, live("t1", 2, 0, "r1", "r1"), [], [], spec, 1e9, role="decode") is desired


def test_a_role_scaled_down_mid_rollout_goes_on_rolling() -> None:
    """Prefill 2 -> 1 after a template change left it at replicas 2, partition 2 (no new pod yet):
    its ordinal 1 is surge now and takes the template, so decode, which does not surge, is not left
    waiting for a new prefill pod that never comes."""
    spec = RolloutSpec.model_validate({"prefill": {"maxSurge": 1}})
    actual = live("t2", 2, 2, "r1", "r2")
    moved = rollout.step(
        sts(1, "t2"), actual, [pod(0, "r1"), pod(1, "r1")], [pod(0, "d1", fingerprint=OLD_FP)], spec, 1e9,
        0.0, role="prefill",
    )  # fmt: skip
    assert (moved["spec"]["replicas"], partition_of(moved)) == (2, 1)
