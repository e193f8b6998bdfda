"""Prefill and decode engines: StatefulSet, headless Service and PodDisruptionBudget per role; the pod
around the container (engine_container), which runs what engine_command says. Pure."""

from __future__ import annotations

from typing import Any

from dllm_operator.api import DisaggregatedLLM
from dllm_operator.config import OperatorConfig
from dllm_operator.render import labels
from dllm_operator.render.digest import digest
from dllm_operator.render.engine_command import EngineRole, role_spec
from dllm_operator.render.engine_container import engine_container, runs_as_root, volumes_and_mounts
from dllm_operator.render.fingerprint import kv_fingerprint

MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
TEMPLATE_HASH = "disagg.dev/template-hash"
# The replicas active autoscaling set for the role (autoscale/act.py), kept for a restarted operator.
AUTOSCALED_REPLICAS = "disagg.dev/autoscaled-replicas"
# The images' numeric non-root user (images/vllm, images/vllm-cpu); engines run as it unless RDMA needs
# a capability, which Kubernetes gives only to root.
ENGINE_UID = 10001


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
    fingerprint = kv_fingerprint(cr, config)
    kv_labels = {labels.KV_FINGERPRINT: fingerprint, labels.DS_REVISION: fingerprint}
    template_metadata: dict[str, Any] = {
        "labels": {**spec.pod_labels, **kv_labels, **labels.labels(cr, role)}
    }
    annotations = pod_annotations(cr, role)
    if annotations:
        template_metadata["annotations"] = annotations
    return {"metadata": template_metadata, "spec": pod}


def template_hash(template: dict[str, Any]) -> str:
    """A short hash of a pod template: the operator's surge rollout (rollout.py) starts when it moves."""
    return digest(template)


def statefulset(cr: DisaggregatedLLM, role: EngineRole, config: OperatorConfig) -> dict[str, Any]:
    spec = role_spec(cr, role)
    template = pod_template(cr, role, config)
    body: dict[str, Any] = {
        "serviceName": labels.child_name(cr, role),
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": labels.selector(cr, role)},
        "template": template,
        "updateStrategy": {"type": "RollingUpdate"},
    }
    if spec.replicas is not None:  # unset: the replica count belongs to an autoscaler
        body = {"replicas": spec.replicas, **body}
    metadata = labels.metadata(cr, role)
    metadata["annotations"] = {**metadata.get("annotations", {}), TEMPLATE_HASH: template_hash(template)}
    if spec.replicas is not None and role in cr.spec.autoscaling.active_roles():
        metadata["annotations"][AUTOSCALED_REPLICAS] = str(spec.replicas)  # autoscale/act.py's count
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": body}


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
