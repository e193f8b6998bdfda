"""spec.prefill, spec.decode, spec.router and spec.security: the pods and who may reach them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from dllm_contract.router_defaults import DEFAULT_HTTP_PORT, DEFAULT_REQUEST_TIMEOUT_S
from dllm_contract.types import Port, PositiveFloat
from dllm_operator.api.common import (
    CA_TRUST_ENV_NAMES,
    CONTROL_PLANE_NOTE,
    HUB_ADDRESS_ENV,
    HUB_ENV_PREFIX,
    HUB_SWITCHES,
    OPERATOR_ENV_NAMES,
    OPTED_IN,
    RESERVED_ENV_NAMES,
    FreeForm,
    Name,
    Quantity,
    TensorParallelSize,
    _Model,
    cel,
    env_name_reserved,
    rules,
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
    f"{', '.join(OPERATOR_ENV_NAMES)}; the hub's address: {HUB_ADDRESS_ENV} and {HUB_ENV_PREFIX}* but "
    f"{', '.join(HUB_SWITCHES)}; the certificate authorities HTTPS trusts: {', '.join(CA_TRUST_ENV_NAMES)})"
)
_RESERVED_LIST = ", ".join(f"'{name}'" for name in RESERVED_ENV_NAMES)
_SWITCH_LIST = ", ".join(f"'{name}'" for name in HUB_SWITCHES)
_ENV_RULE = (
    f"self.all(e, !(e.name in [{_RESERVED_LIST}]) && "
    f"(!e.name.startsWith('{HUB_ENV_PREFIX}') || e.name in [{_SWITCH_LIST}]))"
)

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
    port: Port = Field(DEFAULT_HTTP_PORT, description="The engine's HTTP port (OpenAI API, /health).")
    resources: ResourceRequirements = Field(ResourceRequirements(), description=RESOURCES)
    env: tuple[EnvVar, ...] = Field(
        (),
        max_length=64,
        description="Extra environment variables (core/v1 EnvVar). Names the operator sets for KV transfer "
        "(VLLM_KV_*, MOONCAKE_*, MC_GID_INDEX, VLLM_HOST_IP, DLLM_ENGINE_ID) and authentication "
        f"({', '.join(OPERATOR_ENV_NAMES)}), the hub's address ({HUB_ADDRESS_ENV}, {HUB_ENV_PREFIX}* but "
        f"its on/off switches) and the CA bundles HTTPS trusts ({', '.join(CA_TRUST_ENV_NAMES)}) are "
        "refused. The chart's admission policy refuses valueFrom.secretKeyRef "
        "other than the model's hub token Secret outside opted-in namespaces.",
        json_schema_extra=rules(cel(_ENV_RULE, ENV_RESERVED)),
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
            if env_name_reserved(var.name):
                raise ValueError(
                    f"env may not set {var.name}: the operator owns the KV-transfer contract, "
                    "authentication and hub address names"
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
DEFAULT_ROUTER_GRACE_SECONDS = int(DEFAULT_REQUEST_TIMEOUT_S) + 30
MIN_ROUTER_GRACE_SECONDS = 15  # the 5 s preStop sleep plus the 10 s the router keeps to shut down


class RouterSpec(_Model):
    enabled: bool = Field(
        True, description="Deploy the router; false: clients talk to the engines themselves."
    )
    replicas: Annotated[int, Field(ge=0, le=1000)] = Field(1, description="Router pods.")
    port: Port = Field(DEFAULT_HTTP_PORT, description="The router Service's port.")
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
        "(dllm-router --drain-seconds). The default covers the router's "
        f"{DEFAULT_REQUEST_TIMEOUT_S:.0f} s request timeout, so a rollout does not cut streams.",
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
        description="Authenticate the data plane with a per-resource Secret (<name>-dllm-auth, random, "
        "made by the operator): the KV side channel's HMAC key (DLLM_KV_AUTH_TOKEN), vLLM's --api-key on /v1 "
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
