"""The only place child names, labels and selectors are made.

Selectors are small and never change (StatefulSet selectors are immutable), and never hold user labels.
"""

from __future__ import annotations

from typing import Any, Literal

from dllm_operator.api import API_VERSION, KIND, DisaggregatedLLM

Component = Literal["prefill", "decode", "router"]

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "app.kubernetes.io/managed-by"

# On both roles' pods: the KV-compatibility fingerprint (render/fingerprint.py), under our name and
# under the LWS DisaggregatedSet's revision label, which llm-d-router's revision screener pairs by.
KV_FINGERPRINT = "disagg.dev/kv-fingerprint"
DS_REVISION = "disaggregatedset.x-k8s.io/revision"

APP_NAME = "dllm"
MANAGER = "dllm-operator"
# Longest child name: StatefulSet pods get a controller-revision-hash label of name + 11 characters.
MAX_STATEFULSET_NAME = 52


def child_name(cr: DisaggregatedLLM, component: Component) -> str:
    return f"{cr.name}-{component}"


def selector(cr: DisaggregatedLLM, component: Component) -> dict[str, str]:
    return {NAME: APP_NAME, INSTANCE: cr.name, COMPONENT: component}


def selector_string(cr: DisaggregatedLLM, component: Component) -> str:
    return ",".join(f"{key}={value}" for key, value in selector(cr, component).items())


def labels(cr: DisaggregatedLLM, component: Component) -> dict[str, str]:
    return selector(cr, component) | {PART_OF: cr.name, MANAGED_BY: MANAGER}


def instance_selector(cr: DisaggregatedLLM) -> dict[str, str]:
    """Every child of one CR (for listing and pruning)."""
    return {NAME: APP_NAME, INSTANCE: cr.name, MANAGED_BY: MANAGER}


def owner_reference(cr: DisaggregatedLLM) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": cr.name,
        "uid": cr.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(cr: DisaggregatedLLM, component: Component, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or child_name(cr, component),
        "namespace": cr.namespace,
        "labels": labels(cr, component),
        "ownerReferences": [owner_reference(cr)],
    }


def shared_metadata(cr: DisaggregatedLLM, name: str) -> dict[str, Any]:
    """Metadata of a child that belongs to no single component (a NetworkPolicy over both engines)."""
    return {
        "name": name,
        "namespace": cr.namespace,
        "labels": instance_selector(cr) | {PART_OF: cr.name},
        "ownerReferences": [owner_reference(cr)],
    }


def service_host(cr: DisaggregatedLLM, component: Component, cluster_domain: str) -> str:
    return f"{child_name(cr, component)}.{cr.namespace}.svc.{cluster_domain}"
