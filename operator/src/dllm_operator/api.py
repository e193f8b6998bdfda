"""The DisaggregatedLLM API (v1alpha1) as a typed, frozen model.

It mirrors crds/disaggregatedllms.disagg.dev.yaml: the same fields, defaults, bounds and cross-field
rules, reported with the same field paths (`spec.kvTransfer.port: ...`), so a CR that the API server
would refuse is refused here too (the operator parses every CR through it; `render` parses files).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from dllm_contract.kvconfig import (
    CONTRACT_ENV_NAMES,
    Compression,
    Connector,
    LoadFailurePolicy,
    Protocol,
)

GROUP = "disagg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedLLM"
PLURAL = "disaggregatedllms"

# Env names the operator sets beside the KV-transfer contract: the auth Secret's keys (render/auth.py)
# and Mooncake's port range (render/ports.py). A role's `env` may not use them either.
OPERATOR_ENV_NAMES: tuple[str, ...] = (
    "DLLM_KV_AUTH_TOKEN",
    "VLLM_API_KEY",
    "DLLM_ENGINE_API_KEY",
    "DLLM_KV_TRANSFER_PORTS",
)
RESERVED_ENV_NAMES: tuple[str, ...] = tuple(sorted({*CONTRACT_ENV_NAMES, *OPERATOR_ENV_NAMES}))

MAX_NAME_LENGTH = 44
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
Name = Annotated[str, Field(max_length=253)]
Quantity = str | int
TensorParallelSize = Literal[1, 2, 4, 8, 16, 32, 64]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


def _check_quantity(value: Quantity) -> Quantity:
    if isinstance(value, str) and not QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a quantity (e.g. 16Gi, 500m, 2)")
    return value


# ---- spec.model -----------------------------------------------------------------------------------


class PVCSource(_Model):
    claim_name: Annotated[str, Field(min_length=1, max_length=253)]
    sub_path: Annotated[str, Field(max_length=1024)] = ""
    read_only: bool = True


class SecretKeyRef(_Model):
    name: Name
    key: Name


class HuggingFaceSource(_Model):
    token_secret_ref: SecretKeyRef | None = None
    cache_volume_claim: Name = ""


class ModelSource(_Model):
    pvc: PVCSource | None = None
    hugging_face: HuggingFaceSource | None = None


class ModelSpec(_Model):
    name: Annotated[str, Field(min_length=1, max_length=512)]
    revision: Annotated[str, Field(max_length=128)] = ""
    served_model_name: Annotated[str, Field(max_length=256)] = ""
    max_model_len: PositiveInt | None = None
    block_size: Annotated[int, Field(ge=1, le=1024)] | None = None
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"] = "auto"
    source: ModelSource | None = None


# ---- spec.kvTransfer, spec.rdma -------------------------------------------------------------------


class CustomConnectorSpec(_Model):
    connector_class: Annotated[str, Field(min_length=1, max_length=253)]
    module_path: Annotated[str, Field(max_length=512)] = ""
    extra_config: dict[str, Any] = Field(default_factory=dict)


class KVTransferSpec(_Model):
    connector: Connector = Connector.MOONCAKE
    compression: Compression = Compression.NONE
    port: Port = 50051
    buffer_size_gb: PositiveFloat = Field(4.0, alias="bufferSizeGB")
    transfer_threshold_tokens: PositiveInt = 1024
    timeout_ms: PositiveInt = 5000
    prefill_wait_ms: PositiveInt = 60000
    hold_seconds: PositiveInt = 480
    async_transfer: bool = Field(True, alias="async")
    protocol: Literal["", "rdma", "tcp"] = ""
    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.FAIL
    custom: CustomConnectorSpec | None = None


class RDMAMode(StrEnum):
    DEVICE_PLUGIN = "devicePlugin"
    HOST_DEVICES = "hostDevices"


class RDMASpec(_Model):
    enabled: bool = False
    mode: RDMAMode = RDMAMode.DEVICE_PLUGIN
    resource_name: Name = "rdma/hca_shared_devices_a"
    resources_per_pod: Annotated[int, Field(ge=1, le=64)] = 1
    devices: Annotated[tuple[Annotated[str, Field(max_length=64)], ...], Field(max_length=64)] = ()
    gid_index: Annotated[int, Field(ge=0, le=255)] | None = None
    networks: Annotated[tuple[Name, ...], Field(max_length=64)] = ()
    host_network: bool = False
    ipc_lock: bool = True


# ---- spec.prefill / spec.decode -------------------------------------------------------------------


class EnvVar(_Model):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    value: Annotated[str, Field(max_length=32768)] | None = None
    value_from: dict[str, Any] | None = None


class ResourceRequirements(_Model):
    limits: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(default_factory=dict)
    requests: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(default_factory=dict)

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, value: dict[str, Quantity]) -> dict[str, Quantity]:
        for quantity in value.values():
            _check_quantity(quantity)
        return value


class Toleration(_Model):
    key: Name = ""
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, Field(max_length=256)] = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    toleration_seconds: Annotated[int, Field(ge=0)] | None = None


StringMap = Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=64)]

# Kubernetes ids are int32; uid 0 (root) is the operator's to choose (RDMA capabilities), never the CR's.
UserId = Annotated[int, Field(ge=1, le=2**31 - 1)]
GroupId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class SeccompProfile(_Model):
    type: Literal["RuntimeDefault", "Localhost"]
    localhost_profile: Annotated[str, Field(min_length=1, max_length=4096)] | None = None


class EngineSecurityContext(_Model):
    """The pod securityContext fields a CR may set (H7): identities and a seccomp profile. Nothing that
    adds privilege (privileged, capabilities, allowPrivilegeEscalation, Unconfined) has a field here."""

    run_as_user: UserId | None = None
    run_as_group: GroupId | None = None
    fs_group: GroupId | None = None
    seccomp_profile: SeccompProfile | None = None


class RoleSpec(_Model):
    replicas: Annotated[int, Field(ge=0, le=10000)] | None = None
    tensor_parallel_size: TensorParallelSize = 1
    max_num_seqs: PositiveInt
    max_num_batched_tokens: PositiveInt
    enable_chunked_prefill: bool | None = None
    buffer_size_gb: PositiveFloat | None = Field(None, alias="bufferSizeGB")
    image: Annotated[str, Field(max_length=512)] = ""
    port: Port = 8000
    resources: ResourceRequirements = ResourceRequirements()
    env: Annotated[tuple[EnvVar, ...], Field(max_length=64)] = ()
    extra_args: Annotated[tuple[Annotated[str, Field(max_length=1024)], ...], Field(max_length=64)] = ()
    node_selector: StringMap = Field(default_factory=dict)
    tolerations: Annotated[tuple[Toleration, ...], Field(max_length=64)] = ()
    affinity: dict[str, Any] = Field(default_factory=dict)
    topology_spread_constraints: Annotated[tuple[dict[str, Any], ...], Field(max_length=16)] = ()
    priority_class_name: Name = ""
    termination_grace_period_seconds: Annotated[int, Field(ge=0, le=86400)] = 120
    shm_size_limit: Quantity = "16Gi"
    pod_labels: StringMap = Field(default_factory=dict)
    pod_annotations: StringMap = Field(default_factory=dict)
    security_context: EngineSecurityContext = EngineSecurityContext()

    @field_validator("shm_size_limit")
    @classmethod
    def _shm_quantity(cls, value: Quantity) -> Quantity:
        return _check_quantity(value)

    @field_validator("env")
    @classmethod
    def _no_contract_names(cls, env: tuple[EnvVar, ...]) -> tuple[EnvVar, ...]:
        for var in env:
            if var.name in RESERVED_ENV_NAMES:
                raise ValueError(
                    f"env may not set {var.name}: the operator owns the KV-transfer contract and "
                    "authentication names"
                )
        return env


class PrefillSpec(RoleSpec):
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 8192


class DecodeSpec(RoleSpec):
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    enable_chunked_prefill: bool | None = False


# The router's default request timeout (dllm-router --request-timeout-s) plus its preStop sleep and a
# margin: a stream started just before SIGTERM can finish (M4).
DEFAULT_ROUTER_GRACE_SECONDS = 630
MIN_ROUTER_GRACE_SECONDS = 15  # the 5 s preStop sleep plus the 10 s the router keeps to shut down


class RouterSpec(_Model):
    enabled: bool = True
    replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    port: Port = 8000
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    flow: Literal["auto", "dllm", "mooncake", "nixl"] = "auto"
    image: Annotated[str, Field(max_length=512)] = ""
    resources: ResourceRequirements = ResourceRequirements()
    node_selector: StringMap = Field(default_factory=dict)
    tolerations: Annotated[tuple[Toleration, ...], Field(max_length=64)] = ()
    termination_grace_period_seconds: Annotated[int, Field(ge=MIN_ROUTER_GRACE_SECONDS, le=86400)] = (
        DEFAULT_ROUTER_GRACE_SECONDS
    )


# A core/v1 NetworkPolicyPeer (podSelector, namespaceSelector, ipBlock), passed through as is.
NetworkPolicyPeer = dict[str, Any]


class SecuritySpec(_Model):
    """Isolation and authentication of the data plane; both on unless a user turns them off."""

    network_policy: bool = True
    authentication: bool = True
    router_allowed_from: Annotated[tuple[NetworkPolicyPeer, ...], Field(max_length=16)] = ()
    engine_allowed_from: Annotated[tuple[NetworkPolicyPeer, ...], Field(max_length=16)] = ()


class LocalObjectReference(_Model):
    name: Name


class Spec(_Model):
    model: ModelSpec
    image: Annotated[str, Field(max_length=512)] = ""
    image_pull_secrets: Annotated[tuple[LocalObjectReference, ...], Field(max_length=16)] = ()
    service_account_name: Name = ""
    kv_transfer: KVTransferSpec = KVTransferSpec()
    rdma: RDMASpec = RDMASpec()
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    router: RouterSpec = RouterSpec()
    security: SecuritySpec = SecuritySpec()


class Metadata(BaseModel):
    """The metadata fields the operator uses; the rest is the API server's business."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0


class DisaggregatedLLM(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    metadata: Metadata
    spec: Spec

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


# ---- parsing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecInvalid(ValueError):
    """A DisaggregatedLLM the API server would refuse; `errors` name each field."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(str(error) for error in errors))
        self.errors = errors


def _dotted(location: tuple[int | str, ...]) -> str:
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _pydantic_errors(error: ValidationError) -> list[FieldError]:
    errors = []
    for item in error.errors():
        location = tuple(part for part in item["loc"] if not str(part).startswith("function-"))
        message = item["msg"].removeprefix("Value error, ")
        errors.append(FieldError(_dotted(location), message))
    return errors


def _metadata_errors(metadata: Mapping[str, Any]) -> list[FieldError]:
    name = str(metadata.get("name", ""))
    if not DNS_1035.match(name):
        return [
            FieldError(
                "metadata.name",
                "must be a DNS-1035 label: lower-case letters, digits and '-', starting with a letter",
            )
        ]
    if len(name) > MAX_NAME_LENGTH:
        return [
            FieldError(
                "metadata.name",
                f"may be at most {MAX_NAME_LENGTH} characters (child "
                "StatefulSet names carry '-prefill' and must stay within 52)",
            )
        ]
    return []


def _cross_field_errors(spec: Spec) -> list[FieldError]:
    """The CRD's CEL rules, with the same paths."""
    errors = []
    kv = spec.kv_transfer
    if (kv.connector is Connector.CUSTOM) != (kv.custom is not None):
        errors.append(
            FieldError("spec.kvTransfer.custom", "custom is required when connector is custom, and only then")
        )
    source = spec.model.source
    if source is not None and source.pvc is not None and source.hugging_face is not None:
        errors.append(FieldError("spec.model.source", "at most one of pvc and huggingFace may be set"))
    if spec.rdma.mode is RDMAMode.HOST_DEVICES and not spec.rdma.enabled:
        errors.append(FieldError("spec.rdma.mode", "mode hostDevices requires enabled: true"))
    if spec.rdma.host_network and not spec.rdma.enabled:
        errors.append(FieldError("spec.rdma.hostNetwork", "hostNetwork requires enabled: true"))
    if kv.protocol == Protocol.RDMA.value and not spec.rdma.enabled:
        errors.append(
            FieldError("spec.kvTransfer.protocol", "kvTransfer.protocol rdma requires rdma.enabled: true")
        )
    for role_name, role in (("prefill", spec.prefill), ("decode", spec.decode)):
        errors += _security_context_errors(spec, role_name, role.security_context)
        max_len = spec.model.max_model_len
        if (
            max_len is not None
            and role.enable_chunked_prefill is False
            and role.max_num_batched_tokens < max_len
        ):
            errors.append(
                FieldError(
                    f"spec.{role_name}.maxNumBatchedTokens",
                    f"{role_name}.maxNumBatchedTokens must be at least model.maxModelLen when "
                    f"{role_name}.enableChunkedPrefill is false",
                )
            )
    return errors


def rdma_adds_capabilities(rdma: RDMASpec) -> bool:
    """IPC_LOCK (ipcLock) or SYS_RESOURCE (hostDevices): engines then run as root, the only user
    Kubernetes gives added capabilities to."""
    return rdma.enabled and (rdma.ipc_lock or rdma.mode is RDMAMode.HOST_DEVICES)


def _security_context_errors(spec: Spec, role: str, context: EngineSecurityContext) -> list[FieldError]:
    path = f"spec.{role}.securityContext"
    errors = []
    seccomp = context.seccomp_profile
    if seccomp is not None and (seccomp.type == "Localhost") != (seccomp.localhost_profile is not None):
        errors.append(
            FieldError(
                f"{path}.seccompProfile.localhostProfile",
                "localhostProfile is required when type is Localhost, and only then",
            )
        )
    if context.run_as_user is not None and rdma_adds_capabilities(spec.rdma):
        errors.append(
            FieldError(
                f"{path}.runAsUser",
                "runAsUser may not be set while rdma adds a capability (ipcLock, hostDevices): "
                "capabilities reach only root; set rdma.ipcLock false in devicePlugin mode",
            )
        )
    return errors


def parse(body: Mapping[str, Any]) -> DisaggregatedLLM:
    """Parse a DisaggregatedLLM (a CR body or a file); raises SpecInvalid naming every bad field."""
    metadata = body.get("metadata") or {}
    errors = _metadata_errors(metadata)
    if body.get("spec") is None:
        raise SpecInvalid([*errors, FieldError("spec", "Required value")])
    try:
        # Strict JSON validation: "8" is not an integer and "yes" is not a boolean, as for the API server.
        spec = Spec.model_validate_json(json.dumps(body["spec"]), strict=True)
    except ValidationError as error:
        located = [FieldError(f"spec.{e.path}", e.message) for e in _pydantic_errors(error)]
        raise SpecInvalid(errors + located) from None
    errors += _cross_field_errors(spec)
    if errors:
        raise SpecInvalid(errors)
    return DisaggregatedLLM(metadata=Metadata.model_validate(metadata), spec=spec)
