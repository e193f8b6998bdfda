"""The whole resource: the spec with its cross-field rules, the status, the metadata."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from dllm_operator.api.autoscaling import AutoscalingSpec, hand_set_in_active_mode
from dllm_operator.api.common import DNS_1035, MAX_NAME_LENGTH, OPTED_IN, Name, _Model, cel, rules
from dllm_operator.api.model_spec import ModelSpec
from dllm_operator.api.roles import DecodeSpec, LocalObjectReference, PrefillSpec, RouterSpec, SecuritySpec
from dllm_operator.api.rollout import RolloutSpec
from dllm_operator.api.transfer import KVTransferSpec, RDMASpec

RDMA_PROTOCOL_NEEDS_RDMA = "kvTransfer.protocol rdma requires rdma.enabled: true"
ROLES = ("prefill", "decode")


def _short_batch(role: str) -> str:
    return (
        f"{role}.maxNumBatchedTokens must be at least model.maxModelLen when {role}.enableChunkedPrefill "
        "is false"
    )


RUN_AS_USER_WITH_CAPABILITY = (
    "runAsUser may not be set while rdma adds a capability (ipcLock, hostDevices): capabilities reach only "
    "root; set rdma.ipcLock false in devicePlugin mode"
)


def _spec_rules() -> JsonDict:
    protocol = cel(
        "!has(self.kvTransfer) || !has(self.kvTransfer.protocol) || self.kvTransfer.protocol != 'rdma' || "
        "(has(self.rdma) && has(self.rdma.enabled) && self.rdma.enabled)",
        RDMA_PROTOCOL_NEEDS_RDMA,
        ".kvTransfer.protocol",
    )
    chunked = [
        cel(
            f"!has(self.model.maxModelLen) || !has(self.{role}) || !has(self.{role}.enableChunkedPrefill) || "
            f"self.{role}.enableChunkedPrefill || !has(self.{role}.maxNumBatchedTokens) || "
            f"self.{role}.maxNumBatchedTokens >= self.model.maxModelLen",
            _short_batch(role),
            f".{role}.maxNumBatchedTokens",
        )
        for role in ROLES
    ]
    root = [
        cel(
            f"!has(self.{role}) || !has(self.{role}.securityContext) || "
            f"!has(self.{role}.securityContext.runAsUser) || !has(self.rdma) || !has(self.rdma.enabled) || "
            "!self.rdma.enabled || ((has(self.rdma.ipcLock) && !self.rdma.ipcLock) && "
            "(!has(self.rdma.mode) || self.rdma.mode != 'hostDevices'))",
            RUN_AS_USER_WITH_CAPABILITY,
            f".{role}.securityContext.runAsUser",
        )
        for role in ROLES
    ]
    hand_set = [
        cel(
            f"!has(self.{role}) || !has(self.{role}.replicas) || !has(self.autoscaling) || "
            "!has(self.autoscaling.mode) || self.autoscaling.mode != 'active' || "
            f"!has(self.autoscaling.{role})",
            hand_set_in_active_mode(role),
            f".{role}.replicas",
        )
        for role in ROLES
    ]
    return rules(protocol, *chunked, *root, *hand_set)


class Spec(_Model):
    """The desired prefill/decode topology."""

    model_config = ConfigDict(json_schema_extra=_spec_rules())

    model: ModelSpec = Field(
        description="The model both roles serve, with the engine settings that must match on prefill "
        "and decode."
    )
    image: Annotated[str, Field(max_length=512)] = Field(
        "",
        description="Serving image (vLLM with this project's connector and Mooncake); roles may override; "
        "default from the operator's configuration.",
    )
    image_pull_secrets: Annotated[tuple[LocalObjectReference, ...], Field(max_length=16)] = Field(
        (),
        description="Secrets of this namespace for pulling the images, by name: the kubelet uses them to "
        "pull, the pods never see their contents.",
    )
    service_account_name: Name = Field(
        "",
        description="ServiceAccount of the engine pods; default: the namespace's default. The engines mount "
        "no token either way, but they run this resource's image and arguments with the account's identity "
        "(its pull secrets, cloud workload identity): the chart's admission policy refuses any other "
        f"account outside {OPTED_IN}.",
    )
    kv_transfer: KVTransferSpec = Field(
        KVTransferSpec(),
        description="How KV cache moves from prefill to decode (vLLM KV transfer). Written into each "
        "engine's environment (VLLM_KV_*) and turned into vLLM's --kv-transfer-config by the image's "
        "entrypoint.",
    )
    rdma: RDMASpec = Field(
        RDMASpec(), description="RDMA NICs for the Mooncake transfer engine (mlx5/InfiniBand/RoCE)."
    )
    prefill: PrefillSpec = Field(
        PrefillSpec(), description="The prefill engines: a StatefulSet of vLLM servers."
    )
    decode: DecodeSpec = Field(DecodeSpec(), description="The decode engines: a StatefulSet of vLLM servers.")
    router: RouterSpec = Field(
        RouterSpec(),
        description="The PD router: the OpenAI-compatible endpoint that sends each request through prefill "
        "then decode.",
    )
    rollout: RolloutSpec = Field(
        RolloutSpec(), description="How a change to the engines' pods rolls out (surge, pause)."
    )
    autoscaling: AutoscalingSpec = Field(
        AutoscalingSpec(),
        description="Replicas per role from the engines' own signals: recommended (advisory) or set by the "
        "operator (active).",
    )
    security: SecuritySpec = Field(
        SecuritySpec(),
        description="Isolation and authentication of the data plane. Both are on by default; turning one off "
        "is an explicit choice. The namespace is the trust boundary: anyone who can create pods with this "
        "resource's labels in its namespace can join its Services (docs/isolation.md).",
    )


# ---- status (written by the operator; here for the CRD's schema) ----------------------------------


class StatusCondition(BaseModel):
    """A condition (metav1.Condition)."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    type: Annotated[
        str,
        Field(
            max_length=64,
            description="Ready, Progressing, Degraded, PrefillReady, DecodeReady, RouterReady, "
            "KVTransferVerified or RolloutProgressing.",
        ),
    ]
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: Annotated[str, Field(max_length=128)] | None = Field(None, description="CamelCase reason.")
    message: Annotated[str, Field(max_length=32768)] | None = Field(
        None, description="Human-readable detail."
    )
    last_transition_time: datetime | None = Field(None, description="When status last changed.")
    observed_generation: int | None = Field(
        None, description="The generation this condition was computed for."
    )


class RouterStatus(BaseModel):
    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    replicas: int | None = Field(None, description="Pods that exist.")
    ready_replicas: int | None = Field(None, description="Pods that are Ready.")
    updated_replicas: int | None = Field(None, description="Pods at the current revision.")
    ready: Annotated[str, Field(max_length=32)] | None = Field(
        None, description="ready/desired, for display."
    )


class FingerprintCount(BaseModel):
    """How many of a role's pods carry one KV fingerprint."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    fingerprint: Annotated[str, Field(max_length=63)] = Field(description="The KV fingerprint.")
    pods: int = Field(description="The role's pods with it (pods on their way out aside).")
    ready: int = Field(description="Of those, the ready ones.")


class RoleStatus(RouterStatus):
    selector: Annotated[str, Field(max_length=1024)] | None = Field(
        None, description="Label selector of the role's pods (for the /scale subresource)."
    )
    kv_fingerprint: Annotated[str, Field(max_length=63)] | None = Field(
        None,
        description="The KV fingerprint of the role's pod template, which new pods get (the router pairs "
        "only pods of equal fingerprints).",
    )
    pod_fingerprints: Annotated[tuple[FingerprintCount, ...], Field(max_length=16)] | None = Field(
        None, description="The KV fingerprints the role's pods carry now: two while a rollout moves them."
    )


class RolloutStatus(BaseModel):
    """When the latest rollout of the engines' pods started and completed."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    started_at: datetime | None = Field(None, description="When RolloutProgressing left Complete.")
    completed_at: datetime | None = Field(
        None, description="When it was Complete again (absent while the rollout runs)."
    )


class KVPairStatus(BaseModel):
    """One prefill/decode pair's latest KV check."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    prefill: Annotated[str, Field(max_length=253)] = Field(description="The prefill pod.")
    decode: Annotated[str, Field(max_length=253)] = Field(description="The decode pod.")
    reason: Annotated[str, Field(max_length=64)] = Field(description="This pair's KV check reason.")
    message: Annotated[str, Field(max_length=1024)] | None = Field(None, description="What the check saw.")
    checked_at: datetime | None = Field(None, description="When the router last checked this pair.")


class KVTransferStatus(BaseModel):
    """The router's KV check: a canary through each ready pair, proven by decode's own record."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    reason: Annotated[str, Field(max_length=64)] = Field(
        description="Verified, RDMAFallbackToTCP, Recomputed, TransferFailed, NoCompletePair, Pending or "
        "RouterUnreachable (as the KVTransferVerified condition)."
    )
    message: Annotated[str, Field(max_length=4096)] | None = Field(None, description="Detail.")
    pairs: Annotated[tuple[KVPairStatus, ...], Field(max_length=32)] | None = Field(
        None, description="The latest verdict of each checked pair, failures first."
    )


class RoleRecommendation(BaseModel):
    """One role's recommended replicas (spec.autoscaling), and in active mode what was done about it."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    replicas: int = Field(description="The replicas the role should run.")
    current: int = Field(description="The replicas it runs now.")
    measure: Annotated[str, Field(max_length=64)] = Field(description="What its target measures.")
    value: float | None = Field(None, description="The measure's value (absent: no fresh signal).")
    reason: Annotated[str, Field(max_length=1024)] = Field(description="How the count was reached.")
    action: Annotated[str, Field(max_length=1024)] | None = Field(
        None,
        description="Active mode: the step last taken toward it, or why none was (empty: none needed).",
    )


class AutoscalingStatus(BaseModel):
    """The autoscaler's latest recommendation."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    decided_at: datetime | None = Field(None, description="When the signals behind it were read.")
    prefill: RoleRecommendation | None = Field(None, description="Prefill's recommendation.")
    decode: RoleRecommendation | None = Field(None, description="Decode's recommendation.")


class Status(BaseModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    observed_generation: int | None = Field(None, description="The generation the operator last acted on.")
    prefill: RoleStatus | None = Field(None, description="Observed state of the prefill engines.")
    decode: RoleStatus | None = Field(None, description="Observed state of the decode engines.")
    router: RouterStatus | None = Field(None, description="Observed state of the router.")
    endpoint: Annotated[str, Field(max_length=512)] | None = Field(
        None, description="URL of the router Service."
    )
    kv_transfer: KVTransferStatus | None = Field(
        None, description="Whether KV really moves between prefill and decode (the router's KV check)."
    )
    rollout: RolloutStatus | None = Field(None, description="The latest rollout of the engines' pods.")
    autoscaling: AutoscalingStatus | None = Field(
        None, description="Recommended replicas per role (spec.autoscaling), with the signals behind them."
    )
    conditions: Annotated[tuple[StatusCondition, ...], Field(max_length=16)] | None = Field(
        None,
        description="Current conditions.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


# ---- the resource ---------------------------------------------------------------------------------

NOT_DNS_1035 = "must be a DNS-1035 label: lower-case letters, digits and '-', starting with a letter"
NAME_TOO_LONG = (
    f"may be at most {MAX_NAME_LENGTH} characters (child StatefulSet names carry '-prefill' and must stay "
    "within 52)"
)


class Metadata(BaseModel):
    """The metadata fields the operator uses; the rest is the API server's business."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0


class DisaggregatedLLM(BaseModel):
    """DisaggregatedLLM serves one model with separate prefill and decode vLLM engines, KV cache moving
    between them (Mooncake or NCCL), behind one router endpoint."""

    model_config = ConfigDict(
        frozen=True,
        extra="ignore",
        json_schema_extra=rules(
            cel(f"self.metadata.name.matches('{DNS_1035.pattern}')", f"metadata.name {NOT_DNS_1035}"),
            cel(f"self.metadata.name.size() <= {MAX_NAME_LENGTH}", f"metadata.name {NAME_TOO_LONG}"),
        ),
    )

    metadata: Metadata
    spec: Spec

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace
