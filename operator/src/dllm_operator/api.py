"""The DisaggregatedLLM API (v1alpha1) as a typed, frozen model, and the source of its CRD.

Every schema fact lives here once: descriptions, bounds, enums and defaults on the fields, the CRD's CEL
rules (`x-kubernetes-validations`) beside the Python checks that mirror them, with the same messages and
field paths (`spec.kvTransfer.port: ...`). `crd.py` turns this model into
crds/disaggregatedllms.disagg.dev.yaml, so a CR the API server would refuse is refused here too (the
operator parses every CR through it; `render` parses files).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from dllm_contract.kvconfig import (
    CONTRACT_ENV_NAMES,
    DEFAULT_BUFFER_SIZE_GB,
    DEFAULT_HOLD_SECONDS,
    DEFAULT_KV_PORT,
    DEFAULT_PREFILL_WAIT_MS,
    DEFAULT_TRANSFER_THRESHOLD_TOKENS,
    DEFAULT_TRANSFER_TIMEOUT_MS,
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
# Kubernetes' own resource.Quantity syntax.
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


# ---- Kubernetes schema markers (read by crd.py) ---------------------------------------------------

INT_OR_STRING: JsonDict = {"x-kubernetes-int-or-string": True}
# Free-form objects: core types passed through as is (the API server keeps any field under them).
PRESERVE_UNKNOWN: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}
# The CRD leaves out empty defaults ('', [], {}): they mean "unset", and CEL's has() stays false. A field
# marked so has an empty default that is a choice of its own (listed in its enum), written like any other.
EMPTY_DEFAULT_IS_A_CHOICE = "x-dllm-empty-default-is-a-choice"


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One x-kubernetes-validations entry; `field_path` is relative to where the rule sits."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def rules(*entries: JsonDict) -> JsonDict:
    return {"x-kubernetes-validations": list(entries)}


# ---- shared field types ---------------------------------------------------------------------------

Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
Name = Annotated[str, Field(max_length=253)]
TensorParallelSize = Literal[1, 2, 4, 8, 16, 32, 64]
FreeForm = Annotated[dict[str, Any], Field(json_schema_extra=PRESERVE_UNKNOWN)]


def _check_quantity(value: str | int) -> str | int:
    if isinstance(value, str) and not QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a quantity (e.g. 16Gi, 500m, 2)")
    return value


Quantity = Annotated[
    str | int,
    AfterValidator(_check_quantity),
    Field(description="A quantity.", json_schema_extra={**INT_OR_STRING, "pattern": QUANTITY.pattern}),
]

OPTED_IN = "namespaces an admin labelled dllm.dev/allow-privileged-engines=true"
CONTROL_PLANE_NOTE = (
    "The chart's admission policy refuses node-role.kubernetes.io/control-plane (or master) here, and "
    f"tolerating that taint, outside {OPTED_IN}."
)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


# ---- spec.model -----------------------------------------------------------------------------------


class PVCSource(_Model):
    claim_name: Annotated[
        str, Field(min_length=1, max_length=253, description="Name of the PersistentVolumeClaim.")
    ]
    sub_path: Annotated[
        str, Field(max_length=1024, description="Folder inside the volume that holds the model.")
    ] = ""
    read_only: Annotated[bool, Field(description="Mount read-only.")] = True


class SecretKeyRef(_Model):
    name: Annotated[Name, Field(description="Name of the Secret, in the resource's namespace.")]
    key: Annotated[Name, Field(description="Key in the Secret's data.")]


class HuggingFaceSource(_Model):
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="The hub token, by reference (HF_TOKEN from this Secret key; never copied)."
    )
    cache_volume_claim: Annotated[
        Name, Field(description="PersistentVolumeClaim for the hub cache, shared between restarts.")
    ] = ""


TWO_SOURCES = "at most one of pvc and huggingFace may be set"


class ModelSource(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(cel("!(has(self.pvc) && has(self.huggingFace))", TWO_SOURCES))
    )

    pvc: PVCSource | None = Field(None, description="Weights on a PersistentVolumeClaim, mounted at /models.")
    hugging_face: HuggingFaceSource | None = Field(
        None, description="Download from the Hugging Face hub at start."
    )


class ModelSpec(_Model):
    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=512,
            description="Model name or path: vLLM --model (a hub id, or a path inside the source).",
        ),
    ]
    revision: Annotated[
        str, Field(max_length=128, description="Model revision (branch, tag or commit): vLLM --revision.")
    ] = ""
    served_model_name: Annotated[
        str, Field(max_length=256, description="Name clients use in requests: vLLM --served-model-name.")
    ] = ""
    max_model_len: PositiveInt | None = Field(
        None, description="Context length: vLLM --max-model-len, the same on both roles."
    )
    block_size: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None,
        description="KV-cache block size in tokens: vLLM --block-size, the same on both roles "
        "(vLLM's CPU backend needs a multiple of 32).",
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "auto", description="Weights and activations dtype: vLLM --dtype."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"] = Field(
        "auto",
        description="KV-cache dtype: vLLM --kv-cache-dtype. With fp8 the KV is already 8-bit and "
        "kvTransfer.compression is not applied again.",
    )
    source: ModelSource | None = Field(
        None,
        description="Where the weights come from; at most one of pvc and huggingFace. Unset: the image or "
        "the hub without a token.",
    )


# ---- spec.kvTransfer, spec.rdma -------------------------------------------------------------------


class CustomConnectorSpec(_Model):
    connector_class: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description="Class name: yours in modulePath, or a vLLM built-in such as NixlConnector or "
            "MooncakeConnector.",
        ),
    ]
    module_path: Annotated[
        str,
        Field(
            max_length=512,
            description="Python module that holds the class (vLLM kv_connector_module_path); empty for vLLM "
            "built-ins.",
        ),
    ] = ""
    extra_config: FreeForm = Field(
        default_factory=dict,
        description="Free-form kv_connector_extra_config passed to your connector as is; the API server "
        "keeps any field here without checking it.",
    )


CUSTOM_IFF_CUSTOM = "custom is required when connector is custom, and only then"


class KVTransferSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "(has(self.connector) && self.connector == 'custom') == has(self.custom)",
                CUSTOM_IFF_CUSTOM,
                ".custom",
            )
        )
    )

    connector: Connector = Field(
        Connector.MOONCAKE,
        description="Transfer backend: mooncake (Mooncake transfer engine, RDMA or TCP), pynccl (NCCL, "
        "single node multi-GPU) or custom (a connector class of your own or a vLLM built-in).",
    )
    compression: Compression = Field(
        Compression.NONE,
        description="On-the-wire KV compression: none, fp8 (e4m3) or int8, with per-block scales.",
    )
    port: Port = Field(
        DEFAULT_KV_PORT,
        description="Each engine's own KV listen port (vLLM kv_port); TP rank r's side channel uses "
        "port + r. Mooncake's RPC and data ports come from 128 ports derived from it "
        "(DLLM_KV_TRANSFER_PORTS): port+64..port+191, else the 128 below the port, else a slot in "
        "61000-65479 when those leave 1024-65535 or touch Linux's ephemeral ports 32768-60999 (as the "
        "default does). Keep the roles' HTTP ports out of these.",
    )
    buffer_size_gb: PositiveFloat = Field(
        DEFAULT_BUFFER_SIZE_GB,
        alias="bufferSizeGB",
        description="Registered staging buffer for (compressed) KV, in GB; a role's bufferSizeGB overrides "
        "it. Counted in the pod's memory request.",
    )
    transfer_threshold_tokens: PositiveInt = Field(
        DEFAULT_TRANSFER_THRESHOLD_TOKENS, description="KV is sent in batches of at least this many tokens."
    )
    timeout_ms: PositiveInt = Field(
        DEFAULT_TRANSFER_TIMEOUT_MS, description="Timeout of one transfer, first byte to done, in ms."
    )
    prefill_wait_ms: PositiveInt = Field(
        DEFAULT_PREFILL_WAIT_MS,
        description="How long decode waits for a request's KV to arrive, in ms (covers prefill queueing).",
    )
    hold_seconds: PositiveInt = Field(
        DEFAULT_HOLD_SECONDS, description="How long prefill keeps KV that no decode has claimed, in s."
    )
    async_transfer: bool = Field(
        True,
        alias="async",
        description="Prefill overlaps sending with later work; false: a prefill request finishes only once "
        "its KV is delivered. Decode always loads asynchronously.",
    )
    protocol: Literal["", "rdma", "tcp"] = Field(
        "",
        description="Mooncake transport: rdma or tcp. Empty: rdma when rdma.enabled, else tcp.",
        json_schema_extra={EMPTY_DEFAULT_IS_A_CHOICE: True},
    )
    load_failure_policy: LoadFailurePolicy = Field(
        LoadFailurePolicy.FAIL,
        description="What decode does when KV cannot be loaded: fail the request, or recompute the prompt "
        "(vLLM kv_load_failure_policy).",
    )
    custom: CustomConnectorSpec | None = Field(
        None, description="The connector class, required iff connector is custom."
    )


class RDMAMode(StrEnum):
    DEVICE_PLUGIN = "devicePlugin"
    HOST_DEVICES = "hostDevices"


HOST_DEVICES_NEED_RDMA = "mode hostDevices requires enabled: true"
HOST_NETWORK_NEEDS_RDMA = "hostNetwork requires enabled: true"


class RDMASpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "!has(self.mode) || self.mode != 'hostDevices' || (has(self.enabled) && self.enabled)",
                HOST_DEVICES_NEED_RDMA,
                ".mode",
            ),
            cel(
                "!has(self.hostNetwork) || !self.hostNetwork || (has(self.enabled) && self.enabled)",
                HOST_NETWORK_NEEDS_RDMA,
                ".hostNetwork",
            ),
        )
    )

    enabled: bool = Field(False, description="Give engine pods RDMA devices and use the rdma protocol.")
    mode: RDMAMode = Field(
        RDMAMode.DEVICE_PLUGIN,
        description="devicePlugin: request resourceName from an RDMA device plugin (least privilege). "
        "hostDevices: mount /dev/infiniband from the host (adds IPC_LOCK and SYS_RESOURCE; needs a "
        "namespace that allows hostPath).",
    )
    resource_name: Name = Field(
        "rdma/hca_shared_devices_a", description="Extended resource of the RDMA device plugin."
    )
    resources_per_pod: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="How many of resourceName each engine pod requests."
    )
    devices: Annotated[tuple[Annotated[str, Field(max_length=64)], ...], Field(max_length=64)] = Field(
        (), description="NIC allow-list, e.g. mlx5_0 (MOONCAKE_RDMA_DEVICE); empty: all."
    )
    gid_index: Annotated[int, Field(ge=0, le=255)] | None = Field(
        None, description="RoCE GID index (MC_GID_INDEX); unset: Mooncake's default."
    )
    networks: Annotated[tuple[Name, ...], Field(max_length=64)] = Field(
        (),
        description="Multus NetworkAttachmentDefinition names for the RDMA network "
        "(k8s.v1.cni.cncf.io/networks).",
    )
    host_network: bool = Field(
        False,
        description="Use the host network (requires enabled); then one engine pod per node per role "
        "(anti-affinity) so ports do not clash. NetworkPolicy does not apply to host-network pods, and the "
        f"chart's admission policy refuses it outside {OPTED_IN}.",
    )
    ipc_lock: bool = Field(
        True,
        description="Add the IPC_LOCK capability (with enabled) so Mooncake can pin its registered buffer "
        "whatever the node's memlock limit. Pod Security baseline does not allow IPC_LOCK: set false where "
        "the container runtime gives containers an unlimited RLIMIT_MEMLOCK and the namespace enforces "
        "baseline.",
    )


# ---- spec.prefill / spec.decode -------------------------------------------------------------------


class EnvVar(_Model):
    """One environment variable."""

    name: Annotated[str, Field(min_length=1, max_length=256, description="Variable name.")]
    value: Annotated[str, Field(max_length=32768)] | None = Field(None, description="Literal value.")
    value_from: FreeForm | None = Field(
        None,
        description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef); "
        "checked when the pod is created.",
    )


class ResourceRequirements(_Model):
    limits: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(
        default_factory=dict, description="Resource limits."
    )
    requests: Annotated[dict[str, Quantity], Field(max_length=32)] = Field(
        default_factory=dict, description="Resource requests."
    )


class Toleration(_Model):
    """A toleration."""

    key: Name = Field("", description="Taint key.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal.")
    value: Annotated[str, Field(max_length=256)] = Field("", description="Taint value.")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        "", description="Taint effect; empty matches all."
    )
    toleration_seconds: Annotated[int, Field(ge=0)] | None = Field(
        None, description="For NoExecute: how long the pod stays bound."
    )


def _tolerations(pods: str) -> Any:
    return Field(
        (),
        max_length=64,
        description=f"core/v1 Tolerations of the {pods} pods. The chart's admission policy refuses a "
        f"toleration without a key, or of the control-plane taint, outside {OPTED_IN}.",
    )


StringMap = Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=64)]
RESOURCES = "core/v1 ResourceRequirements merged over the operator's defaults (GPUs, RDMA, memory)."

# Kubernetes ids are int32; uid 0 (root) is the operator's to choose (RDMA capabilities), never the CR's.
UserId = Annotated[int, Field(ge=1, le=2**31 - 1)]
GroupId = Annotated[int, Field(ge=0, le=2**31 - 1)]
INT32 = "Kubernetes ids are int32"
LOCALHOST_PROFILE = "localhostProfile is required when type is Localhost, and only then"


class SeccompProfile(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "(self.type == 'Localhost') == has(self.localhostProfile)",
                LOCALHOST_PROFILE,
                ".localhostProfile",
            )
        )
    )

    type: Literal["RuntimeDefault", "Localhost"] = Field(description="RuntimeDefault or Localhost.")
    localhost_profile: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        None, description="Profile path relative to the kubelet's seccomp directory; with Localhost only."
    )


class EngineSecurityContext(_Model):
    """The pod securityContext fields a CR may set (H7): identities and a seccomp profile. Nothing that
    adds privilege (privileged, capabilities, allowPrivilegeEscalation, Unconfined) has a field here."""

    run_as_user: UserId | None = Field(
        None,
        description=f"uid of the engine processes (not 0; {INT32}). Not with an rdma capability (ipcLock, "
        "hostDevices), which reaches only root.",
    )
    run_as_group: GroupId | None = Field(None, description=f"Primary gid of the engine processes ({INT32}).")
    fs_group: GroupId | None = Field(None, description=f"gid that owns the pod's volumes ({INT32}).")
    seccomp_profile: SeccompProfile | None = Field(
        None,
        description="Seccomp profile: RuntimeDefault, or Localhost with a profile file on the node (never "
        "Unconfined).",
    )


ENV_RESERVED = (
    "env may not set a name the operator owns (the KV-transfer contract: VLLM_KV_*, MOONCAKE_PROTOCOL, "
    "MOONCAKE_RDMA_DEVICE, MC_GID_INDEX, VLLM_HOST_IP, DLLM_ENGINE_ID; authentication and ports: "
    f"{', '.join(OPERATOR_ENV_NAMES)})"
)
_RESERVED_LIST = ", ".join(f"'{name}'" for name in RESERVED_ENV_NAMES)

MaxNumSeqs = Annotated[int, Field(ge=1, description="vLLM --max-num-seqs.")]
MaxNumBatchedTokens = Annotated[int, Field(ge=1, description="vLLM --max-num-batched-tokens.")]
ChunkedPrefill = Annotated[
    bool | None,
    Field(
        description="vLLM --enable-chunked-prefill / --no-enable-chunked-prefill; unset: vLLM's default. "
        "false requires maxNumBatchedTokens >= model.maxModelLen."
    ),
]


class RoleSpec(_Model):
    replicas: Annotated[int, Field(ge=0, le=10000)] | None = Field(
        None,
        description="Number of pods of this role. Unset: the operator leaves the count to an autoscaler "
        "(HPA) on the StatefulSet (for decode also through the /scale subresource).",
    )
    tensor_parallel_size: TensorParallelSize = Field(
        1, description="vLLM --tensor-parallel-size; also the nvidia.com/gpu request."
    )
    max_num_seqs: MaxNumSeqs
    max_num_batched_tokens: MaxNumBatchedTokens
    enable_chunked_prefill: ChunkedPrefill = None
    buffer_size_gb: PositiveFloat | None = Field(
        None, alias="bufferSizeGB", description="Overrides kvTransfer.bufferSizeGB for this role."
    )
    image: Annotated[str, Field(max_length=512)] = Field(
        "", description="Serving image for this role; default spec.image, then the operator's."
    )
    port: Port = Field(8000, description="The engine's HTTP port (OpenAI API, /health).")
    resources: ResourceRequirements = Field(ResourceRequirements(), description=RESOURCES)
    env: tuple[EnvVar, ...] = Field(
        (),
        max_length=64,
        description="Extra environment variables (core/v1 EnvVar). Names the operator sets for KV transfer "
        "(VLLM_KV_*, MOONCAKE_*, MC_GID_INDEX, VLLM_HOST_IP, DLLM_ENGINE_ID) and authentication "
        f"({', '.join(OPERATOR_ENV_NAMES)}) are refused. The chart's admission policy refuses "
        "valueFrom.secretKeyRef other than the model's hub token Secret outside opted-in namespaces.",
        json_schema_extra=rules(cel(f"self.all(e, !(e.name in [{_RESERVED_LIST}]))", ENV_RESERVED)),
    )
    extra_args: Annotated[tuple[Annotated[str, Field(max_length=1024)], ...], Field(max_length=64)] = Field(
        (), description="Extra vLLM arguments, appended after the operator's."
    )
    node_selector: StringMap = Field(
        default_factory=dict, description=f"Node labels the engine pods require. {CONTROL_PLANE_NOTE}"
    )
    tolerations: tuple[Toleration, ...] = _tolerations("engine")
    affinity: FreeForm = Field(
        default_factory=dict,
        description="core/v1 Affinity, passed through to the pod spec as is. The API server does not check "
        "it here: a bad affinity shows as Degraded on this resource, not as an error at apply. Node affinity "
        "onto control-plane nodes needs an opted-in namespace (as nodeSelector).",
    )
    topology_spread_constraints: Annotated[
        tuple[Annotated[FreeForm, Field(description="A topology spread constraint.")], ...],
        Field(max_length=16),
    ] = Field(
        (),
        description="core/v1 TopologySpreadConstraints, passed through as is (checked when the StatefulSet "
        "is applied; a bad one shows as Degraded).",
    )
    priority_class_name: Name = Field(
        "",
        description="PriorityClass of the engine pods. The chart's admission policy refuses the system- "
        f"classes (they preempt every other pod) outside {OPTED_IN}.",
    )
    termination_grace_period_seconds: Annotated[int, Field(ge=0, le=86400)] = Field(
        120, description="Seconds a pod gets to drain in-flight requests on deletion (preStop first)."
    )
    shm_size_limit: Quantity = Field("16Gi", description="Size of the memory-backed /dev/shm.")
    pod_labels: StringMap = Field(
        default_factory=dict, description="Extra pod labels (never used in selectors)."
    )
    pod_annotations: StringMap = Field(default_factory=dict, description="Extra pod annotations.")
    security_context: EngineSecurityContext = Field(
        EngineSecurityContext(),
        description="Pod securityContext fields over the operator's (non-root uid 10001 with fsGroup 10001 "
        "and seccomp RuntimeDefault; root only where rdma adds a capability). Identities and the seccomp "
        "profile only: nothing here can make a container privileged, add capabilities or allow privilege "
        "escalation.",
    )

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
    max_num_seqs: MaxNumSeqs = 64
    max_num_batched_tokens: MaxNumBatchedTokens = 8192


class DecodeSpec(RoleSpec):
    max_num_seqs: MaxNumSeqs = 256
    max_num_batched_tokens: MaxNumBatchedTokens = 2048
    enable_chunked_prefill: ChunkedPrefill = False


# The router's default request timeout (dllm-router --request-timeout-s) plus its preStop sleep and a
# margin: a stream started just before SIGTERM can finish (M4).
DEFAULT_ROUTER_GRACE_SECONDS = 630
MIN_ROUTER_GRACE_SECONDS = 15  # the 5 s preStop sleep plus the 10 s the router keeps to shut down


class RouterSpec(_Model):
    enabled: bool = Field(
        True, description="Deploy the router; false: clients talk to the engines themselves."
    )
    replicas: Annotated[int, Field(ge=0, le=1000)] = Field(1, description="Router pods.")
    port: Port = Field(8000, description="The router Service's port.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Service type of the endpoint."
    )
    flow: Literal["auto", "dllm", "mooncake", "nixl"] = Field(
        "auto",
        description="PD request protocol. auto: dllm for mooncake/pynccl, nixl for NixlConnector, mooncake "
        "for vLLM's MooncakeConnector.",
    )
    image: Annotated[str, Field(max_length=512)] = Field(
        "", description="Router image; default the operator's."
    )
    resources: ResourceRequirements = Field(ResourceRequirements(), description=RESOURCES)
    node_selector: StringMap = Field(
        default_factory=dict, description=f"Node labels the router pods require. {CONTROL_PLANE_NOTE}"
    )
    tolerations: tuple[Toleration, ...] = _tolerations("router")
    termination_grace_period_seconds: Annotated[int, Field(ge=MIN_ROUTER_GRACE_SECONDS, le=86400)] = Field(
        DEFAULT_ROUTER_GRACE_SECONDS,
        description="Seconds a router pod gets on deletion: a 5 s preStop sleep (endpoints catch up), "
        "then it stops accepting and lets in-flight requests finish for this minus "
        f"{MIN_ROUTER_GRACE_SECONDS} s "
        "(dllm-router --drain-seconds). The default covers the router's 600 s request timeout, so a rollout "
        "does not cut streams.",
    )


# A networking.k8s.io/v1 NetworkPolicyPeer (podSelector, namespaceSelector, ipBlock), passed through as is.
NetworkPolicyPeer = Annotated[
    FreeForm,
    Field(
        description="A networking.k8s.io/v1 NetworkPolicyPeer (podSelector, namespaceSelector, ipBlock), "
        "passed through as is (a bad one shows as Degraded)."
    ),
]


class SecuritySpec(_Model):
    """Isolation and authentication of the data plane; both on unless a user turns them off."""

    network_policy: bool = Field(
        True,
        description="Render NetworkPolicies: the engines accept any port from this resource's engines and "
        "only their HTTP port from its router pods (plus engineAllowedFrom); the router pods accept their "
        "port from routerAllowedFrom (default anywhere). Needs a CNI that enforces NetworkPolicy; false: no "
        "policy (an existing one is deleted).",
    )
    authentication: bool = Field(
        True,
        description="Authenticate the data plane with a per-resource Secret (<name>-auth, random, made by "
        "the operator): the KV side channel's HMAC key (DLLM_KV_AUTH_TOKEN), vLLM's --api-key on /v1 "
        "(VLLM_API_KEY; /health and /metrics stay open) and the key the router sends "
        "(DLLM_ENGINE_API_KEY). false: none of these.",
    )
    router_allowed_from: Annotated[tuple[NetworkPolicyPeer, ...], Field(max_length=16)] = Field(
        (), description="Who may reach the router pods' port, with networkPolicy. Empty: anyone."
    )
    engine_allowed_from: Annotated[tuple[NetworkPolicyPeer, ...], Field(max_length=16)] = Field(
        (),
        description="Extra peers allowed on the engines' HTTP port (/health, /metrics, /v1), with "
        "networkPolicy: e.g. a Prometheus namespace, or node addresses (ipBlock) where the CNI polices the "
        "kubelet's probes.",
    )


class LocalObjectReference(_Model):
    """A Secret reference."""

    name: Name = Field(description="Secret name.")


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
    return rules(protocol, *chunked, *root)


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
            description="Ready, Progressing, Degraded, PrefillReady, DecodeReady or RouterReady.",
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


class RoleStatus(RouterStatus):
    selector: Annotated[str, Field(max_length=1024)] | None = Field(
        None, description="Label selector of the role's pods (for the /scale subresource)."
    )


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
        return [FieldError("metadata.name", NOT_DNS_1035)]
    if len(name) > MAX_NAME_LENGTH:
        return [FieldError("metadata.name", NAME_TOO_LONG)]
    return []


def _cross_field_errors(spec: Spec) -> list[FieldError]:
    """The CRD's CEL rules (on the models above), with the same paths and messages."""
    errors = []
    kv = spec.kv_transfer
    if (kv.connector is Connector.CUSTOM) != (kv.custom is not None):
        errors.append(FieldError("spec.kvTransfer.custom", CUSTOM_IFF_CUSTOM))
    source = spec.model.source
    if source is not None and source.pvc is not None and source.hugging_face is not None:
        errors.append(FieldError("spec.model.source", TWO_SOURCES))
    if spec.rdma.mode is RDMAMode.HOST_DEVICES and not spec.rdma.enabled:
        errors.append(FieldError("spec.rdma.mode", HOST_DEVICES_NEED_RDMA))
    if spec.rdma.host_network and not spec.rdma.enabled:
        errors.append(FieldError("spec.rdma.hostNetwork", HOST_NETWORK_NEEDS_RDMA))
    if kv.protocol == Protocol.RDMA.value and not spec.rdma.enabled:
        errors.append(FieldError("spec.kvTransfer.protocol", RDMA_PROTOCOL_NEEDS_RDMA))
    for role_name, role in (("prefill", spec.prefill), ("decode", spec.decode)):
        errors += _security_context_errors(spec, role_name, role.security_context)
        max_len = spec.model.max_model_len
        if (
            max_len is not None
            and role.enable_chunked_prefill is False
            and role.max_num_batched_tokens < max_len
        ):
            errors.append(FieldError(f"spec.{role_name}.maxNumBatchedTokens", _short_batch(role_name)))
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
        errors.append(FieldError(f"{path}.seccompProfile.localhostProfile", LOCALHOST_PROFILE))
    if context.run_as_user is not None and rdma_adds_capabilities(spec.rdma):
        errors.append(FieldError(f"{path}.runAsUser", RUN_AS_USER_WITH_CAPABILITY))
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
