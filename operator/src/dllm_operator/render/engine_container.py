"""The engine's container: image, command, ports, resources (GPUs, RDMA, the pinned buffer), its
security context (never privileged), volumes, probes and the preStop drain. Pure."""

from __future__ import annotations

from typing import Any

from dllm_contract.kv_fingerprint import ENV_KV_FINGERPRINT
from dllm_operator.api import DisaggregatedLLM, RDMAMode, RoleSpec
from dllm_operator.config import OperatorConfig
from dllm_operator.render.engine_command import (
    HF_CACHE_MOUNT,
    MODEL_MOUNT,
    EngineRole,
    buffer_size_gb,
    drain_budget_s,
    engine_args,
    engine_env,
    role_spec,
)
from dllm_operator.render.fingerprint import kv_fingerprint
from dllm_operator.render.ports import side_channel_ports
from dllm_operator.render.quantity import gigabytes_to_bytes, mebibytes, to_bytes

CONTAINER = "vllm"
GPU_RESOURCE = "nvidia.com/gpu"


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
    budget = drain_budget_s(spec)
    command = ["python3", "-m", "dllm_connector.drain", "--port", str(spec.port), "--timeout", str(budget)]
    return {"preStop": {"exec": {"command": command}}}


# ---- the container ------------------------------------------------------------------------------


def engine_container(cr: DisaggregatedLLM, role: EngineRole, config: OperatorConfig) -> dict[str, Any]:
    spec = role_spec(cr, role)
    _, mounts = volumes_and_mounts(cr, role)
    return {
        "name": CONTAINER,
        "image": spec.image or cr.spec.image or config.engine_image,
        "command": ["dllm-serve"],
        "args": ["--", *engine_args(cr, role)],
        "ports": engine_ports(cr, role),
        "env": [
            *engine_env(cr, role, config.hub_endpoint),
            {"name": ENV_KV_FINGERPRINT, "value": kv_fingerprint(cr, config)},
        ],
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
