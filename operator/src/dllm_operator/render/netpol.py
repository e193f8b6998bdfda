"""NetworkPolicies of one DisaggregatedLLM (C2). Pure.

The engines (prefill and decode of this resource) accept any port from each other: the KV side
channel, Mooncake's RPC and data ports, torch.distributed's store. From the router pods they accept
only their HTTP port (and, for vLLM's Mooncake flow, prefill's bootstrap port). Without a router, the
engines are the endpoint, so their HTTP port is open to clients. The router pods accept their port
from `security.routerAllowedFrom`, or from anywhere.

Kubelet probes come from the node. Most CNIs (Calico, Cilium, kube-router, Antrea) always admit a
node's traffic to its own pods; where one does not, list the node addresses as an ipBlock in
`security.engineAllowedFrom`. Host-network pods and RDMA traffic are outside NetworkPolicy.
"""

from __future__ import annotations

from typing import Any

from dllm_contract.router_defaults import MOONCAKE_BOOTSTRAP_PORT
from dllm_operator.api import DisaggregatedLLM
from dllm_operator.config import OperatorConfig
from dllm_operator.render import labels
from dllm_operator.render.router import kv_check_args, router_flow

# The label every namespace carries with its own name (Kubernetes 1.22 and later).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

ENGINE_COMPONENTS = ("prefill", "decode")


def engines_policy_name(cr: DisaggregatedLLM) -> str:
    return f"{cr.name}-engines"


def engine_selector(cr: DisaggregatedLLM) -> dict[str, Any]:
    return {
        "matchLabels": {labels.NAME: labels.APP_NAME, labels.INSTANCE: cr.name},
        "matchExpressions": [{"key": labels.COMPONENT, "operator": "In", "values": list(ENGINE_COMPONENTS)}],
    }


def _router_ports(cr: DisaggregatedLLM) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = [{"port": "http", "protocol": "TCP"}]
    if router_flow(cr) == "mooncake":
        ports.append({"port": MOONCAKE_BOOTSTRAP_PORT, "protocol": "TCP"})
    return ports


def engines_policy(cr: DisaggregatedLLM, config: OperatorConfig | None = None) -> dict[str, Any]:
    security = cr.spec.security
    http = [{"port": "http", "protocol": "TCP"}]
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": engine_selector(cr)}]}]
    if config is not None and (operator := autoscaler_peer(cr, config)) is not None:
        ingress.append({"from": [operator], "ports": http})  # the autoscaler reads /metrics
    if cr.spec.router.enabled:
        router_pods = {"podSelector": {"matchLabels": labels.selector(cr, "router")}}
        ingress.append({"from": [router_pods], "ports": _router_ports(cr)})
    if security.engine_allowed_from:
        ingress.append({"from": [dict(peer) for peer in security.engine_allowed_from], "ports": http})
    elif not cr.spec.router.enabled:  # no router: clients call the engines themselves
        ingress.append({"ports": http})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": labels.shared_metadata(cr, engines_policy_name(cr)),
        "spec": {"podSelector": engine_selector(cr), "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _operator_pods(config: OperatorConfig) -> dict[str, Any] | None:
    if not (config.pod_namespace and config.pod_labels):
        return None  # off-cluster: no pods to name
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: config.pod_namespace}},
        "podSelector": {"matchLabels": dict(config.pod_labels)},
    }


def operator_peer(cr: DisaggregatedLLM, config: OperatorConfig) -> dict[str, Any] | None:
    """The operator's pods, where they read this resource's KV check (None off-cluster or unchecked),
    or its routers' metrics for autoscaling."""
    checked = config.kv_check_poll_seconds > 0 and bool(kv_check_args(cr))
    return _operator_pods(config) if checked or autoscaler_peer(cr, config) else None


def autoscaler_peer(cr: DisaggregatedLLM, config: OperatorConfig) -> dict[str, Any] | None:
    """The operator's pods, where its autoscaler reads this resource's metrics pages (issue 36)."""
    if cr.spec.autoscaling.mode == "off" or config.autoscale_poll_seconds <= 0:
        return None
    return _operator_pods(config)


def router_policy(cr: DisaggregatedLLM, config: OperatorConfig) -> dict[str, Any]:
    rule: dict[str, Any] = {"ports": [{"port": "http", "protocol": "TCP"}]}
    if cr.spec.security.router_allowed_from:
        rule["from"] = [dict(peer) for peer in cr.spec.security.router_allowed_from]
        if (operator := operator_peer(cr, config)) is not None:
            rule["from"].append(operator)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": labels.metadata(cr, "router"),
        "spec": {
            "podSelector": {"matchLabels": labels.selector(cr, "router")},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def network_policies(cr: DisaggregatedLLM, config: OperatorConfig) -> list[dict[str, Any]]:
    if not cr.spec.security.network_policy:
        return []
    policies = [engines_policy(cr, config)]
    if cr.spec.router.enabled:
        policies.append(router_policy(cr, config))
    return policies
