"""spec.rollout: how a change to the engines' pods is rolled out."""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import Field

from dllm_operator.api.common import _Model

EngineRole = Literal["prefill", "decode"]
PodCount = Annotated[int, Field(ge=0, le=16)]

_SURGE = (
    "Pods each engine role may run above its replicas while its pods are replaced: the new pods come up "
    "first, then old ones go, a role's old pods only once the other role has a ready pod of the new KV "
    "fingerprint, so a complete pair serves throughout."
)
_UNAVAILABLE = (
    "Pods below its replicas each engine role may be short of while its pods are replaced: old pods "
    "go this many more at a time than the ready surge pods make up for."
)


class RoleRollout(_Model):
    max_surge: PodCount | None = Field(None, description=f"{_SURGE} Unset: spec.rollout.maxSurge.")
    max_unavailable: PodCount | None = Field(
        None, description=f"{_UNAVAILABLE} Unset: spec.rollout.maxUnavailable."
    )


class RoleBudget(NamedTuple):
    """How far one role's replaced pods may go above (surge) and below (unavailable) its replicas."""

    surge: int
    unavailable: int


class RolloutSpec(_Model):
    max_surge: PodCount = Field(
        0,
        description=f"{_SURGE} When this, maxUnavailable and the per-role values are all 0: the "
        "StatefulSets' own rolling update (a role with one replica has no pod while it restarts, and "
        "the roles do not wait for each other). Ignored for a role whose replicas are left to an "
        "autoscaler.",
    )
    max_unavailable: PodCount = Field(
        0,
        description=f"{_UNAVAILABLE} A role whose maxSurge and maxUnavailable are both 0, while the "
        "other's are not, replaces one pod at a time. With neither role surging, prefill replaces first "
        "(there is no complete pair of the new fingerprint to wait for).",
    )
    prefill: RoleRollout = Field(RoleRollout(), description="maxSurge and maxUnavailable for prefill.")
    decode: RoleRollout = Field(RoleRollout(), description="maxSurge and maxUnavailable for decode.")
    max_skew: Annotated[int, Field(ge=1, le=100)] = Field(
        100,
        description="How far, in percent of each role's old pods replaced, one engine role's rollout "
        "may run ahead of the other's: a role ahead by more waits for the other. The role behind (or "
        "level) may always take its next step, so with a small bound the skew reaches at most one step's "
        "share of the role with fewer replicas. 100: no bound beyond the complete pair.",
    )
    paused: bool = Field(
        False,
        description="Hold a coordinated rollout where it is (pods neither added nor replaced) until false.",
    )
    progress_deadline_seconds: Annotated[int, Field(ge=30, le=86400)] = Field(
        1800,
        description="A coordinated rollout that takes no step for this long (its new pods not ready) is "
        "failed: it stops where it is, the old pods serving, RolloutProgressing says "
        "ProgressDeadlineExceeded and the resource is Degraded, until the spec changes again (a fix, or "
        "the change undone).",
    )

    def budget(self, role: EngineRole) -> RoleBudget:
        """The role's surge and unavailability, its own values over the shared ones; one pod at a time
        when both are 0 (as a StatefulSet replaces pods)."""
        own = self.prefill if role == "prefill" else self.decode
        surge = self.max_surge if own.max_surge is None else own.max_surge
        unavailable = self.max_unavailable if own.max_unavailable is None else own.max_unavailable
        return RoleBudget(surge, unavailable if surge or unavailable else 1)

    @property
    def coordinated(self) -> bool:
        """Whether the operator rolls the engine roles (else the StatefulSets' own rolling update)."""
        per_role = [value for own in (self.prefill, self.decode) for value in own.model_dump().values()]
        return any((self.max_surge, self.max_unavailable, *per_role))
