"""What active mode has set, per resource and role, kept by the leader between reconciles (act.py
decides each step; this holds the results and the reasons status shows). No I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dllm_operator import rollout
from dllm_operator.api import DisaggregatedLLM
from dllm_operator.api.autoscaling import ENGINE_ROLES
from dllm_operator.api.rollout import EngineRole
from dllm_operator.autoscale import act
from dllm_operator.autoscale.decide import Decision

Key = Any


@dataclass(frozen=True)
class Scaled:
    role: EngineRole
    before: int
    after: int
    reason: str


@dataclass
class AppliedReplicas:
    _counts: dict[Key, dict[EngineRole, int]] = field(default_factory=dict)
    _actions: dict[Key, dict[EngineRole, str]] = field(default_factory=dict)

    def counts(
        self, key: Key, cr: DisaggregatedLLM, workloads: Mapping[str, dict[str, Any]]
    ) -> dict[EngineRole, int]:
        """Each actively scaled role's count (started from its StatefulSet the first time), within
        the bounds; roles no longer scaled are dropped."""
        spec = cr.spec.autoscaling
        kept = self._counts.setdefault(key, {})
        active = spec.active_roles()
        actions = self._actions.get(key, {})
        for role in list(kept):
            if role not in active:
                del kept[role]
                actions.pop(role, None)
        for role in active:
            if role not in kept:
                kept[role] = act.initial_replicas(spec, role, workloads.get(role), cr.spec.rollout)
            kept[role] = act.within(kept[role], *act.bounds(spec, role))
        return dict(kept)

    def step(
        self,
        key: Key,
        cr: DisaggregatedLLM,
        decision: Decision,
        pods: Mapping[str, Iterable[dict[str, Any]]],
        workloads: Mapping[str, dict[str, Any]],
        now: float,
        measure_seconds: float,
    ) -> list[Scaled]:
        """One step of every actively scaled role with a recommendation; the roles that moved."""
        spec, kept = cr.spec.autoscaling, self._counts.get(key, {})
        rolling = any(
            # not observed: a rollout may just have started, its revisions still reading as the old ones
            rollout.under_way(sts, kept.get(role, getattr(cr.spec, role).replicas))
            or not rollout.observed(sts)
            for role, sts in workloads.items()
            if role in ENGINE_ROLES
        )
        actions = self._actions.setdefault(key, {})
        moved = []
        for role in spec.active_roles():
            found = decision.roles.get(role)
            if role not in kept or found is None:
                continue
            applied, role_pods = kept[role], list(pods.get(role, ()))
            done = act.next_replicas(
                applied,
                found.replicas,
                *act.bounds(spec, role),
                measured=act.measured(role_pods, applied, now, measure_seconds),
                rolling=rolling,
                kept_measured=act.kept_measured(
                    role_pods, rollout.start_of(workloads.get(role)), applied - 1, now, measure_seconds
                ),
            )
            actions[role] = done.reason
            if done.replicas != applied:
                kept[role] = done.replicas
                moved.append(Scaled(role, applied, done.replicas, done.reason))
        return moved

    def actions(self, key: Key) -> dict[EngineRole, str]:
        return dict(self._actions.get(key, {}))

    def forget(self, key: Key) -> None:
        self._counts.pop(key, None)
        self._actions.pop(key, None)

    def forget_all(self) -> None:
        """A new term as leader: another leader may have stepped meanwhile; the StatefulSets' records
        are read again."""
        self._counts.clear()
        self._actions.clear()
