"""spec.rollout: how a change to the engines' pods is rolled out."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from dllm_operator.api.common import _Model


class RolloutSpec(_Model):
    max_surge: Annotated[int, Field(ge=0, le=16)] = Field(
        0,
        description="Pods each engine role may run above its replicas while its pods are replaced: the "
        "new pods come up first, then the old ones go one at a time, a role's old pods only once the "
        "other role has a ready pod of the new KV fingerprint, so a complete pair serves throughout. 0: "
        "the StatefulSets' own rolling update (a role with one replica has no pod while it restarts). "
        "Ignored for a role whose replicas are left to an autoscaler.",
    )
    max_skew: Annotated[int, Field(ge=1, le=100)] = Field(
        100,
        description="How far, in percent of each role's old pods replaced, one engine role's surge rollout "
        "may run ahead of the other's: a role ahead by more waits for the other. The role behind (or "
        "level) may always take its next step, so with a small bound the skew reaches at most one pod's "
        "share of the role with fewer replicas. 100: no bound beyond the complete pair.",
    )
    paused: bool = Field(
        False, description="Hold a surge rollout where it is (pods neither added nor replaced) until false."
    )
    progress_deadline_seconds: Annotated[int, Field(ge=30, le=86400)] = Field(
        1800,
        description="A surge rollout that takes no step for this long (its new pods not ready) is failed: "
        "it stops where it is, the old pods serving, RolloutProgressing says ProgressDeadlineExceeded and "
        "the resource is Degraded, until the spec changes again (a fix, or the change undone).",
    )
