"""kopf registrations, kept thin: watch events go into the controller's caches and queue.

Only watching handlers (@kopf.on.event) are registered: kopf then writes nothing to the resources it
watches (no finalizer, no progress or last-handled-configuration annotations, no per-handler Events).
"""

from __future__ import annotations

from typing import Any

import kopf

from dllm_operator.api import GROUP, PLURAL, VERSION
from dllm_operator.controller import Controller
from dllm_operator.kube import Credentials
from dllm_operator.render import labels

CHILD_RESOURCES = (
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("", "v1", "pods"),
)
CHILD_KINDS = {
    "statefulsets": "StatefulSet",
    "deployments": "Deployment",
    "services": "Service",
    "poddisruptionbudgets": "PodDisruptionBudget",
    "networkpolicies": "NetworkPolicy",
    "pods": "Pod",
}


class NoDiffBase(kopf.DiffBaseStorage):
    """A diff base that keeps nothing: only watching handlers are registered, and they need no diff.

    kopf's default builds the "essence" of every event's body (a deep copy of the whole object, pods'
    managedFields included) to detect changes for changing handlers; in profiles that was the largest
    single cost of the operator's event handling.
    """

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


def configure(settings: kopf.OperatorSettings) -> None:
    """Every kopf setting the operator depends on, chosen on purpose."""
    settings.posting.enabled = False  # our own Events, with reasons, from controller.py; kopf's are noise
    settings.peering.standalone = True  # leader election is our Lease (leader.py), not kopf peering
    settings.scanning.disabled = True  # no CRD/namespace scanning: no RBAC on CRDs or namespaces needed
    settings.watching.server_timeout = 300  # re-list and re-watch every 5 min: a safety net
    settings.watching.reconnect_backoff = 1.0  # after an API server restart, retry the watch every second
    # Unused (no changing handlers), but named so no kopf default ever writes under another prefix.
    settings.persistence.finalizer = f"{GROUP}/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    # kopf 1.45 processes each event as it comes (its time-based batch window is gone); our own work
    # queue (controller.py) coalesces the events of one CR into one reconcile. kopf.objects' per-event
    # lines are quieted by dllm_contract.logs.


def connection_info(credentials: Credentials) -> kopf.ConnectionInfo:
    """kopf's watches use the same identity as our writes (kubeconfig, or the in-cluster token)."""
    cfg = credentials.configuration
    authorization = credentials.authorization()
    return kopf.ConnectionInfo(
        server=credentials.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        scheme="Bearer" if authorization else None,
        token=authorization.split(" ", 1)[1] if authorization else None,
    )


def build_registry(controller: Controller, credentials: Credentials) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(credentials)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def resource_event(event: kopf.RawEvent, **_: Any) -> None:
        body = dict(event["object"])
        body.setdefault("kind", "DisaggregatedLLM")
        controller.on_resource(body, deleted=event.get("type") == "DELETED")

    for group, version, plural in CHILD_RESOURCES:

        @kopf.on.event(
            group,
            version,
            plural,
            registry=registry,
            id=f"child-{plural}",
            labels={labels.MANAGED_BY: labels.MANAGER},
        )
        async def child_event(event: kopf.RawEvent, kind: str = CHILD_KINDS[plural], **_: Any) -> None:
            obj = dict(event["object"])
            obj.setdefault("kind", kind)
            controller.on_child(obj, deleted=event.get("type") == "DELETED")

    return registry
