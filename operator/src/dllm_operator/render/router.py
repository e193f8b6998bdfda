"""The PD router: Deployment and Service (the user's endpoint). Pure."""

from __future__ import annotations

from typing import Any

from dllm_contract.kvconfig import Connector, Protocol
from dllm_contract.router_defaults import (  # when no memory limit is set
    DEFAULT_MAX_ANSWER_MB,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MEMORY_BUDGET_MB,
    KV_CHECK_INTERVAL_S,
)
from dllm_operator.api import DisaggregatedLLM
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth, labels
from dllm_operator.render.engine_command import transfer_protocol
from dllm_operator.render.quantity import to_bytes

# vLLM built-in connectors whose PD protocol the router speaks.
_BUILTIN_FLOWS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}
PRESTOP_SLEEP_S = 5  # endpoints drop a terminating pod a moment after SIGTERM
SHUTDOWN_MARGIN_S = 10  # after the drain: closing connections, flushing logs
DEFAULT_RESOURCES = {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
# H2: a JSON body expands many times once parsed (docs/router.md), and several arrive at once: 1/128 of
# the memory limit.
BODY_FRACTION = 128
MAX_BODY_MB_CAP = 64
# NEW-1: client bodies and engine answers held at once, across requests: a quarter of the memory limit
# (a held byte exists about twice at the peak: as the engine's bytes and in the answer written from them).
BUDGET_FRACTION = 4
# One request's engine answers: a quarter of that budget, so four such requests fit at once.
ANSWER_FRACTION = 16


def router_flow(cr: DisaggregatedLLM) -> str:
    """auto: dllm for this project's connectors; the built-in's own flow; nixl (pull) for other classes."""
    flow = cr.spec.router.flow
    if flow != "auto":
        return flow
    kv = cr.spec.kv_transfer
    if kv.connector is not Connector.CUSTOM or kv.custom is None:
        return "dllm"
    return _BUILTIN_FLOWS.get(kv.custom.connector_class, "nixl")


def router_args(cr: DisaggregatedLLM, config: OperatorConfig) -> list[str]:
    """In a cluster the router finds the engine pods through the headless Services' DNS, by absolute
    names (a final dot): with the pod's ndots 5 a relative name four dots deep is first tried under
    each of the three search domains, so every lookup cost four queries, and under load one of them
    timing out failed it (a new pod went unseen for as long)."""
    prefill = labels.service_host(cr, "prefill", config.cluster_domain) + "."
    decode = labels.service_host(cr, "decode", config.cluster_domain) + "."
    endpoints = ["--prefill-dns", f"{prefill}:{cr.spec.prefill.port}",
                 "--decode-dns", f"{decode}:{cr.spec.decode.port}"]  # fmt: skip
    return router_command_args(cr, cr.spec.router.port, endpoints)


def router_command_args(cr: DisaggregatedLLM, port: int, endpoints: list[str]) -> list[str]:
    """dllm-router's flags, given how it reaches the engines (DNS in a cluster, URLs on one host).

    The other limits (--max-prompts, --max-n, --max-connections, --head-timeout-s, --body-timeout-s)
    stay at the router's defaults."""
    spec = cr.spec
    return [
        "--host", "0.0.0.0",
        "--port", str(port),
        "--flow", router_flow(cr),
        *endpoints,
        "--decode-kv-port", str(spec.kv_transfer.port),
        "--prefill-tp-size", str(spec.prefill.tensor_parallel_size),
        "--decode-tp-size", str(spec.decode.tensor_parallel_size),
        "--max-body-mb", str(max_body_mb(cr)),
        "--memory-budget-mb", str(memory_budget_mb(cr)),
        "--max-answer-mb", str(max_answer_mb(cr)),
        "--drain-seconds", str(drain_seconds(cr)),
        *kv_check_args(cr),
    ]  # fmt: skip


def kv_check_args(cr: DisaggregatedLLM) -> list[str]:
    """The router's KV check (dllm flow): every pair checked as it comes, then each interval; expecting
    RDMA where Mooncake is told to use it."""
    if router_flow(cr) != "dllm" or cr.spec.kv_transfer.connector is Connector.CUSTOM:
        return []  # the check reads our connector's record of each transfer
    args = ["--kv-check-interval-s", f"{KV_CHECK_INTERVAL_S:g}"]
    rdma = cr.spec.kv_transfer.connector == Connector.MOONCAKE and transfer_protocol(cr) == Protocol.RDMA
    return [*args, "--kv-check-rdma", "true"] if rdma else args


def router_resources(cr: DisaggregatedLLM) -> dict[str, Any]:
    router = cr.spec.router
    if router.resources.limits or router.resources.requests:
        return router.resources.model_dump(by_alias=True)
    return DEFAULT_RESOURCES


def memory_limit_bytes(cr: DisaggregatedLLM) -> int | None:
    """The router container's memory limit; None when unset or unreadable (the router's defaults then)."""
    limit = router_resources(cr).get("limits", {}).get("memory")
    try:
        return to_bytes(limit) if limit is not None else None
    except ValueError:  # a quantity spelled in a form this parser does not read (e.g. 1e9)
        return None


def max_body_mb(cr: DisaggregatedLLM) -> int:
    """The largest request body, from the router's memory limit (H2)."""
    limit_bytes = memory_limit_bytes(cr)
    if limit_bytes is None:
        return DEFAULT_MAX_BODY_MB
    return max(1, min(limit_bytes // BODY_FRACTION // 2**20, MAX_BODY_MB_CAP))


def memory_budget_mb(cr: DisaggregatedLLM) -> int:
    """The bytes of bodies and answers held at once across requests, from the memory limit (NEW-1)."""
    limit_bytes = memory_limit_bytes(cr)
    if limit_bytes is None:
        return DEFAULT_MEMORY_BUDGET_MB
    return max(1, limit_bytes // BUDGET_FRACTION // 2**20)


def max_answer_mb(cr: DisaggregatedLLM) -> int:
    """The engine answers one request may hold, from the memory limit (NEW-1)."""
    limit_bytes = memory_limit_bytes(cr)
    if limit_bytes is None:
        return DEFAULT_MAX_ANSWER_MB
    return max(1, limit_bytes // ANSWER_FRACTION // 2**20)


def drain_seconds(cr: DisaggregatedLLM) -> int:
    """What in-flight requests get after SIGTERM: the grace period less the preStop sleep and a margin
    (M4); at least 0 (the CRD's minimum grace is their sum)."""
    grace = cr.spec.router.termination_grace_period_seconds
    return max(grace - PRESTOP_SLEEP_S - SHUTDOWN_MARGIN_S, 0)


def router_deployment(cr: DisaggregatedLLM, config: OperatorConfig) -> dict[str, Any]:
    router = cr.spec.router
    # 5 s to answer, as the engines' probes: with Kubernetes' default of 1 s, a node that stalls for
    # ~15 s under engine load (seen on the 2-core test node) failed three probes in a row and took the
    # only router out of the Service, a moment with no endpoint at all for a router that was only slow.
    health = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image or config.router_image,
        "command": ["dllm-router"],
        "args": router_args(cr, config),
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        # /health, not /ready: while a role has no ready engine the router should still answer, with a
        # 503 naming the role; out of the Service's endpoints, clients would get "network unreachable".
        "readinessProbe": {**health, "periodSeconds": 5},
        # Endpoints drop a terminating pod a moment after SIGTERM: keep accepting until they have.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 6},
        "resources": router_resources(cr),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if cr.spec.security.authentication:  # the engines' vLLM API key, sent as a Bearer token
        container["env"] = [auth.secret_ref(cr, auth.ROUTER_API_KEY_ENV, auth.API_KEY_KEY)]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": router.termination_grace_period_seconds,
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    if router.node_selector:
        pod["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        pod["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) for t in router.tolerations
        ]
    if cr.spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s.name} for s in cr.spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": labels.metadata(cr, "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": labels.selector(cr, "router")},
            "template": {"metadata": {"labels": labels.labels(cr, "router")}, "spec": pod},
        },
    }


def router_service(cr: DisaggregatedLLM) -> dict[str, Any]:
    router = cr.spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": labels.metadata(cr, "router"),
        "spec": {
            "type": router.service_type,
            "selector": labels.selector(cr, "router"),
            "ports": [{"name": "http", "port": router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint(cr: DisaggregatedLLM) -> str:
    return f"http://{labels.child_name(cr, 'router')}.{cr.namespace}.svc:{cr.spec.router.port}"
