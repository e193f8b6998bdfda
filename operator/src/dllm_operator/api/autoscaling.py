"""spec.autoscaling: prefill and decode replicas from their own signals, within bounds (issue 36).
The decision is autoscale/decide.py; advisory mode writes it to status, active mode also applies it,
one replica at a time (autoscale/act.py). An HPA or KEDA on the StatefulSets (replicas unset, mode off
or advisory) stays the other way to act on the same signals.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple, Self

from pydantic import ConfigDict, Field, model_validator

from dllm_operator.api.common import _Model, cel, rules
from dllm_operator.api.rollout import EngineRole

ENGINE_ROLES: tuple[EngineRole, EngineRole] = ("prefill", "decode")

AutoscalingMode = Literal["off", "advisory", "active"]
Replicas = Annotated[int, Field(ge=1, le=10000)]
ONE_TARGET = "exactly one target"
MIN_OVER_MAX = "minReplicas may not exceed maxReplicas"
RATIO_ORDER = "minPrefillPerDecode may not exceed maxPrefillPerDecode"


def hand_set_in_active_mode(role: str) -> str:
    return (
        f"{role}.replicas may not be set while autoscaling.mode is active and autoscaling.{role} is set: "
        f"the autoscaler sets {role}'s replicas; remove {role}.replicas, or autoscaling.{role}, or use "
        "mode advisory"
    )


class Measure(NamedTuple):
    """What a role's target measures, its value per replica, and whether the measure is the role's
    total (divided by the target) rather than a per-replica level or a latency (scaled by it)."""

    name: str
    target: float
    total: bool


class PrefillTarget(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel("has(self.queuedPromptTokensPerReplica) != has(self.timeToFirstTokenSeconds)", ONE_TARGET)
        )
    )

    queued_prompt_tokens_per_replica: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Prompt tokens waiting in the prefill engines' queues, per replica."
    )
    time_to_first_token_seconds: Annotated[float, Field(gt=0)] | None = Field(
        None, description="The router's time to first token (90th percentile over the last minute)."
    )

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.queued_prompt_tokens_per_replica is None) == (self.time_to_first_token_seconds is None):
            raise ValueError(ONE_TARGET)
        return self

    def measure(self) -> Measure:
        if self.queued_prompt_tokens_per_replica is not None:
            return Measure("queued prompt tokens", float(self.queued_prompt_tokens_per_replica), total=True)
        return Measure("time to first token (s)", float(self.time_to_first_token_seconds or 0), total=False)


class DecodeTarget(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel("has(self.kvCacheUsage) != has(self.interTokenLatencySeconds)", ONE_TARGET)
        )
    )

    kv_cache_usage: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="The decode engines' KV-cache usage (vLLM's kv_cache_usage_perc), on average."
    )
    inter_token_latency_seconds: Annotated[float, Field(gt=0)] | None = Field(
        None, description="The router's inter-token latency (90th percentile over the last minute)."
    )

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.kv_cache_usage is None) == (self.inter_token_latency_seconds is None):
            raise ValueError(ONE_TARGET)
        return self

    def measure(self) -> Measure:
        if self.kv_cache_usage is not None:
            return Measure("KV-cache usage", float(self.kv_cache_usage), total=False)
        return Measure("inter-token latency (s)", float(self.inter_token_latency_seconds or 0), total=False)


_BOUNDS = rules(cel("self.minReplicas <= self.maxReplicas", MIN_OVER_MAX))


class PrefillAutoscaling(_Model):
    model_config = ConfigDict(json_schema_extra=_BOUNDS)

    min_replicas: Replicas = Field(1, description="The fewest prefill replicas.")
    max_replicas: Replicas = Field(description="The most prefill replicas.")
    target: PrefillTarget = Field(description="What one prefill replica should carry.")

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_OVER_MAX)
        return self


class DecodeAutoscaling(_Model):
    model_config = ConfigDict(json_schema_extra=_BOUNDS)

    min_replicas: Replicas = Field(1, description="The fewest decode replicas.")
    max_replicas: Replicas = Field(description="The most decode replicas.")
    target: DecodeTarget = Field(description="What one decode replica should carry.")

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_OVER_MAX)
        return self


class RatioBounds(_Model):
    model_config = ConfigDict(
        # has(): the API server checks the rule against the object's default ({}) before defaulting it
        json_schema_extra=rules(
            cel(
                "!has(self.minPrefillPerDecode) || !has(self.maxPrefillPerDecode) || "
                "self.minPrefillPerDecode <= self.maxPrefillPerDecode",
                RATIO_ORDER,
            )
        )
    )

    min_prefill_per_decode: Annotated[float, Field(gt=0, le=64)] = Field(
        1 / 64, description="The fewest prefill replicas per decode replica."
    )
    max_prefill_per_decode: Annotated[float, Field(gt=0, le=64)] = Field(
        64, description="The most prefill replicas per decode replica."
    )

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.min_prefill_per_decode > self.max_prefill_per_decode:
            raise ValueError(RATIO_ORDER)
        return self


class AutoscalingSpec(_Model):
    mode: AutoscalingMode = Field(
        "off",
        description="off; advisory: the operator reads the engines' and router's metrics and writes each "
        "role's recommended replicas, the signal and the reason to status.autoscaling, with an Event when "
        "a recommendation changes; nothing is scaled. active: as advisory, and the operator sets the "
        "replicas of each role configured here itself, one replica per step, the next only once every pod "
        "of the role has been ready long enough to be measured (the router's discovery plus one read of "
        "the metrics), never while a rollout is under way; such a role's replicas may not be set by hand. "
        "Leaving active mode, set the role's replicas in the same edit: left unset, its StatefulSet falls "
        "back to Kubernetes' default of one replica until an HPA sets it.",
    )
    prefill: PrefillAutoscaling | None = Field(
        None, description="Prefill's bounds and target; unset: not scaled."
    )
    decode: DecodeAutoscaling | None = Field(
        None, description="Decode's bounds and target; unset: not scaled."
    )
    ratio: RatioBounds = Field(RatioBounds(), description="Bounds on prefill replicas per decode replica.")
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = Field(
        300,
        description="A role scales down only to the highest count recommended over this window (as an "
        "HPA's scale-down stabilization); scaling up is not delayed.",
    )
    signal_max_age_seconds: Annotated[int, Field(ge=5, le=600)] = Field(
        60, description="A signal older than this is no signal: that role is not scaled, and status says why."
    )

    def active_roles(self) -> tuple[EngineRole, ...]:
        """The roles whose replicas the operator sets (active mode, configured here)."""
        if self.mode != "active":
            return ()
        return tuple(role for role in ENGINE_ROLES if getattr(self, role) is not None)
