"""Writes crds/disaggregatedllms.disagg.dev.yaml, the CRD users apply.

The schema is spelled out here once, in small builders, because the two engine roles share every field
but differ in defaults; the YAML file is committed, reviewed and shipped (chart, kubectl), and a test fails
if it differs from what this script writes. Run: `make crds`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dllm_operator.api import (
    DEFAULT_ROUTER_GRACE_SECONDS,
    MIN_ROUTER_GRACE_SECONDS,
    OPERATOR_ENV_NAMES,
    RESERVED_ENV_NAMES,
)

GROUP = "disagg.dev"
OUT = Path(__file__).resolve().parents[1] / "crds" / f"disaggregatedllms.{GROUP}.yaml"
Schema = dict[str, Any]

TP_SIZES = [1, 2, 4, 8, 16, 32, 64]
# Kubernetes' own resource.Quantity syntax.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
MAX_ITEMS = 64
MAX_NAME = 253
OPTED_IN = "namespaces an admin labelled dllm.dev/allow-privileged-engines=true"
CONTROL_PLANE_NOTE = (
    "The chart's admission policy refuses node-role.kubernetes.io/control-plane (or master) here, and "
    f"tolerating that taint, outside {OPTED_IN}."
)


def string(description: str, max_length: int = MAX_NAME, **extra: Any) -> Schema:
    return {"type": "string", "description": description, "maxLength": max_length, **extra}


def integer(description: str, minimum: int | None = None, maximum: int | None = None, **extra: Any) -> Schema:
    schema: Schema = {"type": "integer", "description": description, **extra}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def port(description: str, **extra: Any) -> Schema:
    return integer(description, 1, 65535, **extra)


def boolean(description: str, **extra: Any) -> Schema:
    return {"type": "boolean", "description": description, **extra}


def positive_number(description: str, **extra: Any) -> Schema:
    return {"type": "number", "description": description, "minimum": 0, "exclusiveMinimum": True, **extra}


def enum(description: str, values: list[Any], default: Any = None, kind: str = "string") -> Schema:
    schema: Schema = {"type": kind, "description": description, "enum": values}
    if default is not None:
        schema["default"] = default
    return schema


def obj(description: str, properties: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


def string_map(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "maxProperties": MAX_ITEMS,
        "additionalProperties": {"type": "string", "maxLength": 4096},
    }


def string_list(description: str, max_length: int = MAX_NAME, **extra: Any) -> Schema:
    return {
        "type": "array",
        "description": description,
        "maxItems": MAX_ITEMS,
        "items": {"type": "string", "maxLength": max_length},
        **extra,
    }


def passthrough(description: str) -> Schema:
    """A core/v1 type the API server does not re-validate here (see the description)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def quantity(description: str, **extra: Any) -> Schema:
    return {
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
        **extra,
    }


def secret_key_ref(description: str) -> Schema:
    return obj(
        description,
        {
            "name": string("Name of the Secret, in the resource's namespace."),
            "key": string("Key in the Secret's data."),
        },
        required=["name", "key"],
    )


# ---- spec.model -----------------------------------------------------------------------------------


def model_schema() -> Schema:
    return obj(
        "The model both roles serve, with the engine settings that must match on prefill and decode.",
        {
            "name": string(
                "Model name or path: vLLM --model (a hub id, or a path inside the source).", 512, minLength=1
            ),
            "revision": string("Model revision (branch, tag or commit): vLLM --revision.", 128),
            "servedModelName": string("Name clients use in requests: vLLM --served-model-name.", 256),
            "maxModelLen": integer("Context length: vLLM --max-model-len, the same on both roles.", 1),
            "blockSize": integer(
                "KV-cache block size in tokens: vLLM --block-size, the same on both roles "
                "(vLLM's CPU backend needs a multiple of 32).",
                1,
                1024,
            ),
            "dtype": enum(
                "Weights and activations dtype: vLLM --dtype.",
                ["auto", "half", "float16", "bfloat16", "float", "float32"],
                "auto",
            ),
            "kvCacheDtype": enum(
                "KV-cache dtype: vLLM --kv-cache-dtype. With fp8 the KV is already 8-bit and "
                "kvTransfer.compression is not applied again.",
                ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"],
                "auto",
            ),
            "source": model_source_schema(),
        },
        required=["name"],
    )


def model_source_schema() -> Schema:
    return obj(
        "Where the weights come from; at most one of pvc and huggingFace. Unset: the image or the hub "
        "without a token.",
        {
            "pvc": obj(
                "Weights on a PersistentVolumeClaim, mounted at /models.",
                {
                    "claimName": string("Name of the PersistentVolumeClaim.", minLength=1),
                    "subPath": string("Folder inside the volume that holds the model.", 1024),
                    "readOnly": boolean("Mount read-only.", default=True),
                },
                required=["claimName"],
            ),
            "huggingFace": obj(
                "Download from the Hugging Face hub at start.",
                {
                    "tokenSecretRef": secret_key_ref(
                        "The hub token, by reference (HF_TOKEN from this Secret key; never copied)."
                    ),
                    "cacheVolumeClaim": string(
                        "PersistentVolumeClaim for the hub cache, shared between restarts."
                    ),
                },
            ),
        },
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.pvc) && has(self.huggingFace))",
                    "message": "at most one of pvc and huggingFace may be set",
                }
            ]
        },
    )


# ---- spec.kvTransfer ------------------------------------------------------------------------------


def kv_transfer_schema() -> Schema:
    return obj(
        "How KV cache moves from prefill to decode (vLLM KV transfer). Written into each engine's "
        "environment (VLLM_KV_*) and turned into vLLM's --kv-transfer-config by the image's entrypoint.",
        {
            "connector": enum(
                "Transfer backend: mooncake (Mooncake transfer engine, RDMA or TCP), pynccl (NCCL, "
                "single node multi-GPU) or custom (a connector class of your own or a vLLM built-in).",
                ["mooncake", "pynccl", "custom"],
                "mooncake",
            ),
            "compression": enum(
                "On-the-wire KV compression: none, fp8 (e4m3) or int8, with per-block scales.",
                ["none", "fp8", "int8"],
                "none",
            ),
            "port": port(
                "Each engine's own KV listen port (vLLM kv_port); TP rank r's side channel uses port + r. "
                "Mooncake's RPC and data ports come from 128 ports derived from it (DLLM_KV_TRANSFER_PORTS): "
                "port+64..port+191, else the 128 below the port, else a slot in 61000-65479 when those "
                "leave 1024-65535 or touch Linux's ephemeral ports 32768-60999 (as the default does). Keep "
                "the roles' HTTP ports out of these.",
                default=50051,
            ),
            "bufferSizeGB": positive_number(
                "Registered staging buffer for (compressed) KV, in GB; a role's bufferSizeGB overrides it. "
                "Counted in the pod's memory request.",
                default=4.0,
            ),
            "transferThresholdTokens": integer(
                "KV is sent in batches of at least this many tokens.", 1, default=1024
            ),
            "timeoutMs": integer("Timeout of one transfer, first byte to done, in ms.", 1, default=5000),
            "prefillWaitMs": integer(
                "How long decode waits for a request's KV to arrive, in ms (covers prefill queueing).",
                1,
                default=60000,
            ),
            "holdSeconds": integer(
                "How long prefill keeps KV that no decode has claimed, in s.", 1, default=480
            ),
            "async": boolean(
                "Prefill overlaps sending with later work; false: a prefill request finishes "
                "only once its KV is delivered. Decode always loads asynchronously.",
                default=True,
            ),
            "protocol": enum(
                "Mooncake transport: rdma or tcp. Empty: rdma when rdma.enabled, else tcp.",
                ["", "rdma", "tcp"],
                "",
            ),
            "loadFailurePolicy": enum(
                "What decode does when KV cannot be loaded: fail the request, or recompute the prompt "
                "(vLLM kv_load_failure_policy).",
                ["fail", "recompute"],
                "fail",
            ),
            "custom": obj(
                "The connector class, required iff connector is custom.",
                {
                    "connectorClass": string(
                        "Class name: yours in modulePath, or a vLLM built-in such as "
                        "NixlConnector or MooncakeConnector.",
                        minLength=1,
                    ),
                    "modulePath": string(
                        "Python module that holds the class (vLLM "
                        "kv_connector_module_path); empty for vLLM built-ins.",
                        512,
                    ),
                    "extraConfig": passthrough(
                        "Free-form kv_connector_extra_config passed to your connector as is; the API "
                        "server keeps any field here without checking it."
                    ),
                },
                required=["connectorClass"],
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.connector) && self.connector == 'custom') == has(self.custom)",
                    "message": "custom is required when connector is custom, and only then",
                    "fieldPath": ".custom",
                }
            ]
        },
    )


def rdma_schema() -> Schema:
    return obj(
        "RDMA NICs for the Mooncake transfer engine (mlx5/InfiniBand/RoCE).",
        {
            "enabled": boolean("Give engine pods RDMA devices and use the rdma protocol.", default=False),
            "mode": enum(
                "devicePlugin: request resourceName from an RDMA device plugin (least privilege). "
                "hostDevices: mount /dev/infiniband from the host (adds IPC_LOCK and "
                "SYS_RESOURCE; needs a namespace that allows hostPath).",
                ["devicePlugin", "hostDevices"],
                "devicePlugin",
            ),
            "resourceName": string(
                "Extended resource of the RDMA device plugin.", default="rdma/hca_shared_devices_a"
            ),
            "resourcesPerPod": integer(
                "How many of resourceName each engine pod requests.", 1, 64, default=1
            ),
            "devices": string_list("NIC allow-list, e.g. mlx5_0 (MOONCAKE_RDMA_DEVICE); empty: all.", 64),
            "gidIndex": integer("RoCE GID index (MC_GID_INDEX); unset: Mooncake's default.", 0, 255),
            "networks": string_list(
                "Multus NetworkAttachmentDefinition names for the RDMA network (k8s.v1.cni.cncf.io/networks)."
            ),
            "hostNetwork": boolean(
                "Use the host network (requires enabled); then one engine pod per node per role "
                "(anti-affinity) so ports do not clash. NetworkPolicy does not apply to host-network "
                "pods, and the chart's admission policy refuses it outside namespaces an admin labelled "
                "dllm.dev/allow-privileged-engines=true.",
                default=False,
            ),
            "ipcLock": boolean(
                "Add the IPC_LOCK capability (with enabled) so Mooncake can pin its registered buffer "
                "whatever the node's memlock limit. Pod Security baseline does not allow IPC_LOCK: set "
                "false where the container runtime gives containers an unlimited RLIMIT_MEMLOCK and the "
                "namespace enforces baseline.",
                default=True,
            ),
        },
        default={},
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.mode) || self.mode != 'hostDevices' || "
                    "(has(self.enabled) && self.enabled)",
                    "message": "mode hostDevices requires enabled: true",
                    "fieldPath": ".mode",
                },
                {
                    "rule": "!has(self.hostNetwork) || !self.hostNetwork || "
                    "(has(self.enabled) && self.enabled)",
                    "message": "hostNetwork requires enabled: true",
                    "fieldPath": ".hostNetwork",
                },
            ]
        },
    )


# ---- spec.prefill / spec.decode -------------------------------------------------------------------


def env_var_schema() -> Schema:
    reserved = ", ".join(f"'{name}'" for name in RESERVED_ENV_NAMES)
    return {
        "type": "array",
        "description": "Extra environment variables (core/v1 EnvVar). Names the operator sets for KV "
        "transfer (VLLM_KV_*, MOONCAKE_*, MC_GID_INDEX, VLLM_HOST_IP, DLLM_ENGINE_ID) and "
        f"authentication ({', '.join(OPERATOR_ENV_NAMES)}) are refused. The chart's admission policy "
        "refuses valueFrom.secretKeyRef other than the model's hub token Secret outside opted-in "
        "namespaces.",
        "maxItems": MAX_ITEMS,
        "items": obj(
            "One environment variable.",
            {
                "name": string("Variable name.", 256, minLength=1),
                "value": string("Literal value.", 32768),
                "valueFrom": passthrough(
                    "A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, "
                    "fieldRef, resourceFieldRef); checked when the pod is created."
                ),
            },
            required=["name"],
        ),
        "x-kubernetes-validations": [
            {
                "rule": f"self.all(e, !(e.name in [{reserved}]))",
                "message": "env may not set a name the operator owns (the KV-transfer contract: VLLM_KV_*, "
                "MOONCAKE_PROTOCOL, MOONCAKE_RDMA_DEVICE, MC_GID_INDEX, VLLM_HOST_IP, DLLM_ENGINE_ID; "
                f"authentication and ports: {', '.join(OPERATOR_ENV_NAMES)})",
            }
        ],
    }


def resources_schema() -> Schema:
    return obj(
        "core/v1 ResourceRequirements merged over the operator's defaults (GPUs, RDMA, memory).",
        {
            "limits": {
                "type": "object",
                "description": "Resource limits.",
                "maxProperties": 32,
                "additionalProperties": quantity("A quantity."),
            },
            "requests": {
                "type": "object",
                "description": "Resource requests.",
                "maxProperties": 32,
                "additionalProperties": quantity("A quantity."),
            },
        },
    )


def tolerations_schema(pods: str = "engine") -> Schema:
    return {
        "type": "array",
        "description": f"core/v1 Tolerations of the {pods} pods. The chart's admission policy refuses a "
        f"toleration without a key, or of the control-plane taint, outside {OPTED_IN}.",
        "maxItems": MAX_ITEMS,
        "items": obj(
            "A toleration.",
            {
                "key": string("Taint key."),
                "operator": enum("Exists or Equal.", ["Exists", "Equal"]),
                "value": string("Taint value.", 256),
                "effect": enum(
                    "Taint effect; empty matches all.", ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]
                ),
                "tolerationSeconds": integer("For NoExecute: how long the pod stays bound.", 0),
            },
        ),
    }


def security_context_schema() -> Schema:
    ids = "Kubernetes ids are int32"
    return obj(
        "Pod securityContext fields over the operator's (non-root uid 10001 with fsGroup 10001 and "
        "seccomp RuntimeDefault; root only where rdma adds a capability). Identities and the seccomp "
        "profile only: nothing here can make a container privileged, add capabilities or allow "
        "privilege escalation.",
        {
            "runAsUser": integer(
                f"uid of the engine processes (not 0; {ids}). Not with an rdma capability "
                "(ipcLock, hostDevices), which reaches only root.",
                1,
                2**31 - 1,
            ),
            "runAsGroup": integer(f"Primary gid of the engine processes ({ids}).", 0, 2**31 - 1),
            "fsGroup": integer(f"gid that owns the pod's volumes ({ids}).", 0, 2**31 - 1),
            "seccompProfile": obj(
                "Seccomp profile: RuntimeDefault, or Localhost with a profile file on the node "
                "(never Unconfined).",
                {
                    "type": enum("RuntimeDefault or Localhost.", ["RuntimeDefault", "Localhost"]),
                    "localhostProfile": string(
                        "Profile path relative to the kubelet's seccomp directory; with Localhost only.",
                        4096,
                        minLength=1,
                    ),
                },
                required=["type"],
                **{
                    "x-kubernetes-validations": [
                        {
                            "rule": "(self.type == 'Localhost') == has(self.localhostProfile)",
                            "message": "localhostProfile is required when type is Localhost, and only then",
                            "fieldPath": ".localhostProfile",
                        }
                    ]
                },
            ),
        },
    )


def role_schema(role: str, defaults: dict[str, Any]) -> Schema:
    chunked_default = defaults.get("enableChunkedPrefill")
    chunked: Schema = boolean(
        "vLLM --enable-chunked-prefill / --no-enable-chunked-prefill; unset: vLLM's default. "
        "false requires maxNumBatchedTokens >= model.maxModelLen."
    )
    if chunked_default is not None:
        chunked["default"] = chunked_default
    return obj(
        f"The {role} engines: a StatefulSet of vLLM servers.",
        {
            "replicas": integer(
                f"Number of {role} pods. Unset: the operator leaves the count to an "
                "autoscaler (HPA) on the StatefulSet"
                + (" or the /scale subresource." if role == "decode" else "."),
                0,
                10000,
            ),
            "tensorParallelSize": enum(
                "vLLM --tensor-parallel-size; also the nvidia.com/gpu request.", TP_SIZES, 1, "integer"
            ),
            "maxNumSeqs": integer("vLLM --max-num-seqs.", 1, default=defaults["maxNumSeqs"]),
            "maxNumBatchedTokens": integer(
                "vLLM --max-num-batched-tokens.", 1, default=defaults["maxNumBatchedTokens"]
            ),
            "enableChunkedPrefill": chunked,
            "bufferSizeGB": positive_number("Overrides kvTransfer.bufferSizeGB for this role."),
            "image": string("Serving image for this role; default spec.image, then the operator's.", 512),
            "port": port("The engine's HTTP port (OpenAI API, /health).", default=8000),
            "resources": resources_schema(),
            "env": env_var_schema(),
            "extraArgs": string_list("Extra vLLM arguments, appended after the operator's.", 1024),
            "nodeSelector": string_map(f"Node labels the engine pods require. {CONTROL_PLANE_NOTE}"),
            "tolerations": tolerations_schema(),
            "affinity": passthrough(
                "core/v1 Affinity, passed through to the pod spec as is. The API server does not check it "
                "here: a bad affinity shows as Degraded on this resource, not as an error at apply. "
                "Node affinity onto control-plane nodes needs an opted-in namespace (as nodeSelector)."
            ),
            "topologySpreadConstraints": {
                "type": "array",
                "description": "core/v1 TopologySpreadConstraints, passed through as is (checked when "
                "the StatefulSet is applied; a bad one shows as Degraded).",
                "maxItems": 16,
                "items": passthrough("A topology spread constraint."),
            },
            "priorityClassName": string(
                "PriorityClass of the engine pods. The chart's admission policy refuses the system- "
                f"classes (they preempt every other pod) outside {OPTED_IN}."
            ),
            "terminationGracePeriodSeconds": integer(
                "Seconds a pod gets to drain in-flight requests on deletion (preStop first).",
                0,
                86400,
                default=120,
            ),
            "shmSizeLimit": quantity("Size of the memory-backed /dev/shm.", default="16Gi"),
            "podLabels": string_map("Extra pod labels (never used in selectors)."),
            "podAnnotations": string_map("Extra pod annotations."),
            "securityContext": security_context_schema(),
        },
        default={},
    )


def router_schema() -> Schema:
    return obj(
        "The PD router: the OpenAI-compatible endpoint that sends each request through prefill then decode.",
        {
            "enabled": boolean(
                "Deploy the router; false: clients talk to the engines themselves.", default=True
            ),
            "replicas": integer("Router pods.", 0, 1000, default=1),
            "port": port("The router Service's port.", default=8000),
            "serviceType": enum(
                "Service type of the endpoint.", ["ClusterIP", "NodePort", "LoadBalancer"], "ClusterIP"
            ),
            "flow": enum(
                "PD request protocol. auto: dllm for mooncake/pynccl, nixl for NixlConnector, "
                "mooncake for vLLM's MooncakeConnector.",
                ["auto", "dllm", "mooncake", "nixl"],
                "auto",
            ),
            "image": string("Router image; default the operator's.", 512),
            "resources": resources_schema(),
            "nodeSelector": string_map(f"Node labels the router pods require. {CONTROL_PLANE_NOTE}"),
            "tolerations": tolerations_schema("router"),
            "terminationGracePeriodSeconds": integer(
                "Seconds a router pod gets on deletion: a 5 s preStop sleep (endpoints catch up), then "
                "it stops accepting and lets in-flight requests finish for this minus 15 s "
                "(dllm-router --drain-seconds). The default covers the router's 600 s request timeout, "
                "so a rollout does not cut streams.",
                MIN_ROUTER_GRACE_SECONDS,
                86400,
                default=DEFAULT_ROUTER_GRACE_SECONDS,
            ),
        },
        default={},
    )


def peers_schema(description: str) -> Schema:
    return {
        "type": "array",
        "description": description,
        "maxItems": 16,
        "items": passthrough(
            "A networking.k8s.io/v1 NetworkPolicyPeer (podSelector, namespaceSelector, ipBlock), passed "
            "through as is (a bad one shows as Degraded)."
        ),
    }


def security_schema() -> Schema:
    return obj(
        "Isolation and authentication of the data plane. Both are on by default; turning one off is an "
        "explicit choice. The namespace is the trust boundary: anyone who can create pods with this "
        "resource's labels in its namespace can join its Services (docs/isolation.md).",
        {
            "networkPolicy": boolean(
                "Render NetworkPolicies: the engines accept any port from this resource's engines and "
                "only their HTTP port from its router pods (plus engineAllowedFrom); the router pods "
                "accept their port from routerAllowedFrom (default anywhere). Needs a CNI that enforces "
                "NetworkPolicy; false: no policy (an existing one is deleted).",
                default=True,
            ),
            "authentication": boolean(
                "Authenticate the data plane with a per-resource Secret (<name>-auth, random, made by the "
                "operator): the KV side channel's HMAC key (DLLM_KV_AUTH_TOKEN), vLLM's --api-key on "
                "/v1 (VLLM_API_KEY; /health and /metrics stay open) and the key the router sends "
                "(DLLM_ENGINE_API_KEY). false: none of these.",
                default=True,
            ),
            "routerAllowedFrom": peers_schema(
                "Who may reach the router pods' port, with networkPolicy. Empty: anyone."
            ),
            "engineAllowedFrom": peers_schema(
                "Extra peers allowed on the engines' HTTP port (/health, /metrics, /v1), with "
                "networkPolicy: e.g. a Prometheus namespace, or node addresses (ipBlock) where the CNI "
                "polices the kubelet's probes."
            ),
        },
        default={},
    )


def spec_schema() -> Schema:
    chunked_rules = [
        {
            "rule": f"!has(self.model.maxModelLen) || !has(self.{role}) || "
            f"!has(self.{role}.enableChunkedPrefill) || self.{role}.enableChunkedPrefill || "
            f"!has(self.{role}.maxNumBatchedTokens) || "
            f"self.{role}.maxNumBatchedTokens >= self.model.maxModelLen",
            "message": f"{role}.maxNumBatchedTokens must be at least model.maxModelLen when "
            f"{role}.enableChunkedPrefill is false",
            "fieldPath": f".{role}.maxNumBatchedTokens",
        }
        for role in ("prefill", "decode")
    ]
    root_rules = [
        {
            "rule": f"!has(self.{role}) || !has(self.{role}.securityContext) || "
            f"!has(self.{role}.securityContext.runAsUser) || !has(self.rdma) || !has(self.rdma.enabled) || "
            "!self.rdma.enabled || ((has(self.rdma.ipcLock) && !self.rdma.ipcLock) && "
            "(!has(self.rdma.mode) || self.rdma.mode != 'hostDevices'))",
            "message": "runAsUser may not be set while rdma adds a capability (ipcLock, hostDevices): "
            "capabilities reach only root; set rdma.ipcLock false in devicePlugin mode",
            "fieldPath": f".{role}.securityContext.runAsUser",
        }
        for role in ("prefill", "decode")
    ]
    return obj(
        "The desired prefill/decode topology.",
        {
            "model": model_schema(),
            "image": string(
                "Serving image (vLLM with this project's connector and Mooncake); roles may "
                "override; default from the operator's configuration.",
                512,
            ),
            "imagePullSecrets": {
                "type": "array",
                "description": "Secrets of this namespace for pulling the images, by name: the kubelet "
                "uses them to pull, the pods never see their contents.",
                "maxItems": 16,
                "items": obj("A Secret reference.", {"name": string("Secret name.")}, required=["name"]),
            },
            "serviceAccountName": string(
                "ServiceAccount of the engine pods; default: the namespace's default. The engines mount "
                "no token either way, but they run this resource's image and arguments with the account's "
                f"identity (its pull secrets, cloud workload identity): the chart's admission policy refuses "
                f"any other account outside {OPTED_IN}."
            ),
            "kvTransfer": kv_transfer_schema(),
            "rdma": rdma_schema(),
            "prefill": role_schema("prefill", {"maxNumSeqs": 64, "maxNumBatchedTokens": 8192}),
            "decode": role_schema(
                "decode", {"maxNumSeqs": 256, "maxNumBatchedTokens": 2048, "enableChunkedPrefill": False}
            ),
            "router": router_schema(),
            "security": security_schema(),
        },
        required=["model"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.kvTransfer) || !has(self.kvTransfer.protocol) || "
                    "self.kvTransfer.protocol != 'rdma' || "
                    "(has(self.rdma) && has(self.rdma.enabled) && self.rdma.enabled)",
                    "message": "kvTransfer.protocol rdma requires rdma.enabled: true",
                    "fieldPath": ".kvTransfer.protocol",
                },
                *chunked_rules,
                *root_rules,
            ]
        },
    )


# ---- status ---------------------------------------------------------------------------------------


def role_status_schema(role: str, with_selector: bool = True) -> Schema:
    props: dict[str, Schema] = {
        "replicas": integer(f"{role} pods that exist."),
        "readyReplicas": integer(f"{role} pods that are Ready."),
        "updatedReplicas": integer(f"{role} pods at the current revision."),
        "ready": string("ready/desired, for display.", 32),
    }
    if with_selector:
        props["selector"] = string("Label selector of the role's pods (for the /scale subresource).", 1024)
    return obj(f"Observed state of the {role}.", props)


def status_schema() -> Schema:
    condition = obj(
        "A condition (metav1.Condition).",
        {
            "type": string("Ready, Progressing, Degraded, PrefillReady, DecodeReady or RouterReady.", 64),
            "status": enum("True, False or Unknown.", ["True", "False", "Unknown"]),
            "reason": string("CamelCase reason.", 128),
            "message": string("Human-readable detail.", 32768),
            "lastTransitionTime": {
                "type": "string",
                "format": "date-time",
                "description": "When status last changed.",
            },
            "observedGeneration": integer("The generation this condition was computed for."),
        },
        required=["type", "status"],
    )
    return obj(
        "Observed state, written by the operator.",
        {
            "observedGeneration": integer("The generation the operator last acted on."),
            "prefill": role_status_schema("prefill"),
            "decode": role_status_schema("decode"),
            "router": role_status_schema("router", with_selector=False),
            "endpoint": string("URL of the router Service.", 512),
            "conditions": {
                "type": "array",
                "description": "Current conditions.",
                "maxItems": 16,
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
    )


def crd() -> Schema:
    root = obj(
        "DisaggregatedLLM serves one model with separate prefill and decode vLLM engines, KV cache moving "
        "between them (Mooncake or NCCL), behind one router endpoint.",
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=["spec"],
        **{
            "x-kubernetes-validations": [
                {
                    "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                    "message": "metadata.name must be a DNS-1035 label: lower-case letters, digits and '-', "
                    "starting with a letter",
                },
                {
                    "rule": "self.metadata.name.size() <= 44",
                    "message": "metadata.name may be at most 44 characters (child StatefulSet names carry "
                    "'-prefill' and must stay within 52)",
                },
            ]
        },
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"disaggregatedllms.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": "DisaggregatedLLM",
                "listKind": "DisaggregatedLLMList",
                "plural": "disaggregatedllms",
                "singular": "disaggregatedllm",
                "shortNames": ["dllm"],
                "categories": ["all", "llm"],
            },
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.decode.replicas",
                            "labelSelectorPath": ".status.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.ready"},
                        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready"},
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {"name": "Connector", "type": "string", "jsonPath": ".spec.kvTransfer.connector"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by tools/crdgen.py (make crds); edit that file, not this one.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=110)


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
