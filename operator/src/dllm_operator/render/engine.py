"""Prefill and decode engines: StatefulSet, headless Service and PodDisruptionBudget per role. Pure."""

from __future__ import annotations

from typing import Any, Literal

from dllm_contract.kvconfig import (
    DOWNWARD_API_ENV,
    CustomConnector,
    KVTransferSettings,
    Protocol,
    Role,
    to_env,
)
from dllm_operator.api import DisaggregatedLLM, RDMAMode, RoleSpec
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth, labels
from dllm_operator.render.ports import side_channel_ports, transfer_port_range
from dllm_operator.render.quantity import gigabytes_to_bytes, mebibytes, to_bytes

EngineRole = Literal["prefill", "decode"]
CONTAINER = "vllm"
MODEL_MOUNT = "/models"
HF_CACHE_MOUNT = "/var/cache/huggingface"
MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
GPU_RESOURCE = "nvidia.com/gpu"
# The images' numeric non-root user (images/vllm, images/vllm-cpu); engines run as it unless RDMA needs
# a capability, which Kubernetes gives only to root.
ENGINE_UID = 10001


def role_spec(cr: DisaggregatedLLM, role: EngineRole) -> RoleSpec:
    return cr.spec.prefill if role == "prefill" else cr.spec.decode


def buffer_size_gb(cr: DisaggregatedLLM, role: EngineRole) -> float:
    return role_spec(cr, role).buffer_size_gb or cr.spec.kv_transfer.buffer_size_gb


def transfer_protocol(cr: DisaggregatedLLM) -> Protocol:
    explicit = cr.spec.kv_transfer.protocol
    if explicit:
        return Protocol(explicit)
    return Protocol.RDMA if cr.spec.rdma.enabled else Protocol.TCP


def kv_settings(cr: DisaggregatedLLM, role: EngineRole) -> KVTransferSettings:
    """The env contract of one role, before the pod-only values (host IP, engine id)."""
    kv = cr.spec.kv_transfer
    custom = None
    if kv.custom is not None:
        custom = CustomConnector(
            connector_class=kv.custom.connector_class,
            module_path=kv.custom.module_path or None,
            extra_config=kv.custom.extra_config,
        )
    sends = role == "prefill"
    return KVTransferSettings(
        connector=kv.connector,
        role=Role(role),
        listen_port=kv.port,
        buffer_size_gb=buffer_size_gb(cr, role),
        compression=kv.compression,
        transfer_threshold_tokens=kv.transfer_threshold_tokens,
        transfer_timeout_ms=kv.timeout_ms,
        prefill_wait_ms=None if sends else kv.prefill_wait_ms,
        hold_seconds=kv.hold_seconds if sends else None,
        async_transfer=kv.async_transfer,
        load_failure_policy=kv.load_failure_policy,
        protocol=transfer_protocol(cr),
        decode_host=labels.child_name(cr, "decode") if sends else None,
        decode_port=kv.port if sends else None,
        transfer_ports=transfer_port_range(kv.port),
        rdma_devices=cr.spec.rdma.devices if cr.spec.rdma.enabled else (),
        gid_index=cr.spec.rdma.gid_index if cr.spec.rdma.enabled else None,
        custom=custom,
    )


def engine_env(cr: DisaggregatedLLM, role: EngineRole) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in to_env(kv_settings(cr, role)).items()]
    env += [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in DOWNWARD_API_ENV.items()
    ]
    if cr.spec.security.authentication:  # by reference: the operator never reads the values
        env += [
            auth.secret_ref(cr, auth.KV_TOKEN_ENV, auth.KV_TOKEN_KEY),
            auth.secret_ref(cr, auth.ENGINE_API_KEY_ENV, auth.API_KEY_KEY),
        ]
    env += _model_source_env(cr)
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in role_spec(cr, role).env]
    return env


def _model_source_env(cr: DisaggregatedLLM) -> list[dict[str, Any]]:
    source = cr.spec.model.source
    if source is None or source.hugging_face is None:
        return []
    hub = source.hugging_face
    env: list[dict[str, Any]] = []
    if hub.token_secret_ref is not None:
        ref = {"name": hub.token_secret_ref.name, "key": hub.token_secret_ref.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if hub.cache_volume_claim:
        env.append({"name": "HF_HOME", "value": HF_CACHE_MOUNT})
    return env


def model_argument(cr: DisaggregatedLLM) -> str:
    source = cr.spec.model.source
    if source is not None and source.pvc is not None:
        return f"{MODEL_MOUNT}/{source.pvc.sub_path}".rstrip("/")
    return cr.spec.model.name


def engine_args(cr: DisaggregatedLLM, role: EngineRole) -> list[str]:
    """vLLM serve flags of one role; the KV-transfer config is added by dllm-serve from the env."""
    model, spec = cr.spec.model, role_spec(cr, role)
    args = ["--model", model_argument(cr)]
    served = model.served_model_name or (model.name if model_argument(cr) != model.name else "")
    optional: list[tuple[str, object]] = [
        ("--served-model-name", served),
        ("--revision", model.revision),
        ("--max-model-len", model.max_model_len),
        ("--block-size", model.block_size),
    ]
    args += [item for flag, value in optional if value for item in (flag, str(value))]
    args += [
        flag
        for name, value in (("--dtype", model.dtype), ("--kv-cache-dtype", model.kv_cache_dtype))
        if value != "auto"
        for flag in (name, value)
    ]
    args += [
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
    ]  # fmt: skip
    if spec.enable_chunked_prefill is not None:
        args.append(
            "--enable-chunked-prefill" if spec.enable_chunked_prefill else "--no-enable-chunked-prefill"
        )
    args += ["--host", "0.0.0.0", "--port", str(spec.port)]
    return args + list(spec.extra_args)


# ---- resources, security, volumes -----------------------------------------------------------------


def engine_resources(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, Any]:
    """GPUs, RDMA and the pinned buffer (added to the memory request) under the user's values."""
    spec, rdma = role_spec(cr, role), cr.spec.rdma
    extended = {GPU_RESOURCE: str(spec.tensor_parallel_size)}
    if rdma.enabled and rdma.mode is RDMAMode.DEVICE_PLUGIN:
        extended[rdma.resource_name] = str(rdma.resources_per_pod)
    user_gpus = {**spec.resources.limits, **spec.resources.requests}.get(GPU_RESOURCE)
    if user_gpus is not None:  # the user's GPU count wins, in requests and limits alike
        extended[GPU_RESOURCE] = str(user_gpus)
    requests: dict[str, Any] = {**spec.resources.requests, **extended}
    limits: dict[str, Any] = {**spec.resources.limits, **extended}
    base_memory = to_bytes(spec.resources.requests.get("memory", 0))
    requests["memory"] = mebibytes(base_memory + gigabytes_to_bytes(buffer_size_gb(cr, role)))
    return {"requests": _without_zero_gpus(requests), "limits": _without_zero_gpus(limits)}


def _without_zero_gpus(resources: dict[str, Any]) -> dict[str, Any]:
    """`nvidia.com/gpu: 0` (in requests or limits) is how a CPU deployment turns the GPU request off."""
    return {k: v for k, v in resources.items() if not (k == GPU_RESOURCE and str(v) == "0")}


def added_capabilities(cr: DisaggregatedLLM) -> list[str]:
    """RDMA pins memory (IPC_LOCK, unless the runtime's memlock limit suffices); host devices also
    raise rlimits."""
    rdma = cr.spec.rdma
    add: list[str] = []
    if rdma.enabled and rdma.ipc_lock:
        add.append("IPC_LOCK")
    if rdma.enabled and rdma.mode is RDMAMode.HOST_DEVICES:
        add.append("SYS_RESOURCE")
    return add


def runs_as_root(cr: DisaggregatedLLM) -> bool:
    """Added capabilities reach only root's processes (Kubernetes sets no ambient capabilities)."""
    return bool(added_capabilities(cr))


def security_context(cr: DisaggregatedLLM) -> dict[str, Any]:
    """Never privileged. Without added capabilities the pod meets Pod Security "restricted" (H7)."""
    add = added_capabilities(cr)
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = add
    context: dict[str, Any] = {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": capabilities,
    }
    if not runs_as_root(cr):
        context["runAsNonRoot"] = True
    return context


def pod_security_context(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, Any]:
    """The operator's choice, then the role's securityContext over it: ids and seccomp only (the model
    has no other field, refuses uid 0 and refuses runAsUser where RDMA needs root)."""
    context: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if not runs_as_root(cr):
        # fsGroup: a writable hub cache volume for the non-root user.
        context |= {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
    overrides = role_spec(cr, role).security_context.model_dump(by_alias=True, exclude_none=True)
    if "fsGroup" in overrides:
        context["fsGroupChangePolicy"] = "OnRootMismatch"
    return context | overrides


def volumes_and_mounts(
    cr: DisaggregatedLLM, role: EngineRole
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = role_spec(cr, role)
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size_limit}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]  # noqa: S108 (the pod's own)
    source = cr.spec.model.source
    if source is not None and source.pvc is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {
                    "claimName": source.pvc.claim_name,
                    "readOnly": source.pvc.read_only,
                },
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": source.pvc.read_only})
    if source is not None and source.hugging_face is not None and source.hugging_face.cache_volume_claim:
        volumes.append(
            {
                "name": "hf-cache",
                "persistentVolumeClaim": {"claimName": source.hugging_face.cache_volume_claim},
            }
        )
        mounts.append({"name": "hf-cache", "mountPath": HF_CACHE_MOUNT})
    if cr.spec.rdma.enabled and cr.spec.rdma.mode is RDMAMode.HOST_DEVICES:
        volumes.append({"name": "infiniband", "hostPath": {"path": "/dev/infiniband", "type": "Directory"}})
        mounts.append({"name": "infiniband", "mountPath": "/dev/infiniband"})
    return volumes, mounts


def probes(port: int) -> dict[str, Any]:
    """Model loads take minutes: a startup probe allows 30 min before liveness counts."""
    health = {"httpGet": {"path": "/health", "port": port}}
    return {
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 180, "timeoutSeconds": 5},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5},
    }


def drain_hook(spec: RoleSpec) -> dict[str, Any]:
    """preStop: wait for in-flight requests to finish, within the grace period, before SIGTERM."""
    budget = max(spec.termination_grace_period_seconds - 10, 0)
    command = ["python3", "-m", "dllm_connector.drain", "--port", str(spec.port), "--timeout", str(budget)]
    return {"preStop": {"exec": {"command": command}}}


# ---- pod, StatefulSet, Service, PDB ---------------------------------------------------------------


def _anti_affinity(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, Any]:
    term = {
        "labelSelector": {"matchLabels": labels.selector(cr, role)},
        "topologyKey": "kubernetes.io/hostname",
    }
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def affinity(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, Any]:
    """The user's affinity; with hostNetwork, plus one pod per node per role (ports would clash)."""
    user = dict(role_spec(cr, role).affinity)
    if not cr.spec.rdma.host_network:
        return user
    anti = dict(user.get("podAntiAffinity", {}))
    required = list(anti.get("requiredDuringSchedulingIgnoredDuringExecution", []))
    required += _anti_affinity(cr, role)["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return {**user, "podAntiAffinity": {**anti, "requiredDuringSchedulingIgnoredDuringExecution": required}}


def engine_container(cr: DisaggregatedLLM, role: EngineRole, config: OperatorConfig) -> dict[str, Any]:
    spec = role_spec(cr, role)
    _, mounts = volumes_and_mounts(cr, role)
    return {
        "name": CONTAINER,
        "image": spec.image or cr.spec.image or config.engine_image,
        "command": ["dllm-serve"],
        "args": ["--", *engine_args(cr, role)],
        "ports": engine_ports(cr, role),
        "env": engine_env(cr, role),
        "resources": engine_resources(cr, role),
        "securityContext": security_context(cr),
        "volumeMounts": mounts,
        "lifecycle": drain_hook(spec),
        **probes(spec.port),
    }


def engine_ports(cr: DisaggregatedLLM, role: EngineRole) -> list[dict[str, Any]]:
    """HTTP, and each TP rank's side channel (rank r: kv port + r). Mooncake's 64-port range
    (DLLM_KV_TRANSFER_PORTS) is not listed: the engines' NetworkPolicy admits any port between them."""
    spec = role_spec(cr, role)
    kv_ports = side_channel_ports(cr.spec.kv_transfer.port, spec.tensor_parallel_size)
    return [
        {"name": "http", "containerPort": spec.port, "protocol": "TCP"},
        *(
            {"name": "kv" if rank == 0 else f"kv-{rank}", "containerPort": port, "protocol": "TCP"}
            for rank, port in enumerate(kv_ports)
        ),
    ]


def pod_annotations(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, str]:
    annotations = dict(role_spec(cr, role).pod_annotations)
    if cr.spec.rdma.enabled and cr.spec.rdma.networks:
        annotations[MULTUS_ANNOTATION] = ",".join(cr.spec.rdma.networks)
    return annotations


def pod_template(cr: DisaggregatedLLM, role: EngineRole, config: OperatorConfig) -> dict[str, Any]:
    spec = role_spec(cr, role)
    volumes, _ = volumes_and_mounts(cr, role)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "securityContext": pod_security_context(cr, role),
        "containers": [engine_container(cr, role, config)],
        "volumes": volumes,
    }
    optional: dict[str, Any] = {
        "serviceAccountName": cr.spec.service_account_name,
        "imagePullSecrets": [{"name": s.name} for s in cr.spec.image_pull_secrets],
        "nodeSelector": dict(spec.node_selector),
        "tolerations": [
            t.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) for t in spec.tolerations
        ],
        "affinity": affinity(cr, role),
        "topologySpreadConstraints": [dict(c) for c in spec.topology_spread_constraints],
        "priorityClassName": spec.priority_class_name,
    }
    pod |= {key: value for key, value in optional.items() if value}
    if cr.spec.rdma.host_network:
        pod |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    template_metadata: dict[str, Any] = {"labels": {**spec.pod_labels, **labels.labels(cr, role)}}
    annotations = pod_annotations(cr, role)
    if annotations:
        template_metadata["annotations"] = annotations
    return {"metadata": template_metadata, "spec": pod}


def statefulset(cr: DisaggregatedLLM, role: EngineRole, config: OperatorConfig) -> dict[str, Any]:
    spec = role_spec(cr, role)
    body: dict[str, Any] = {
        "serviceName": labels.child_name(cr, role),
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": labels.selector(cr, role)},
        "template": pod_template(cr, role, config),
        "updateStrategy": {"type": "RollingUpdate"},
    }
    if spec.replicas is not None:  # unset: the replica count belongs to an autoscaler
        body = {"replicas": spec.replicas, **body}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": labels.metadata(cr, role),
        "spec": body,
    }


def headless_service(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, Any]:
    """Stable pod DNS for the StatefulSet, and the router's discovery (ready pods only)."""
    spec = role_spec(cr, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": labels.metadata(cr, role),
        "spec": {
            "clusterIP": "None",
            "selector": labels.selector(cr, role),
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"},
                {"name": "kv", "port": cr.spec.kv_transfer.port, "targetPort": "kv", "protocol": "TCP"},
            ],
        },
    }


def disruption_budget(cr: DisaggregatedLLM, role: EngineRole) -> dict[str, Any] | None:
    replicas = role_spec(cr, role).replicas
    if replicas is None or replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": labels.metadata(cr, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels.selector(cr, role)}},
    }
