"""The only Kubernetes API I/O of the operator (kopf does its own watching).

A small asyncio client on aiohttp: server-side apply under one field manager with strict field validation,
deletes, status patches, Events and Leases. Credentials come from the kubeconfig or the in-cluster
ServiceAccount through the `kubernetes` package's loaders (so every auth method kubectl supports works);
bearer tokens are refreshed through its hook and never logged.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from dllm_operator.api import GROUP, PLURAL, VERSION

FIELD_MANAGER = "dllm-operator"
USER_AGENT = "dllm-operator/0.1.0"

# kind -> (API prefix, plural) for the kinds the operator writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Secret": ("/api/v1", "secrets"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "DisaggregatedLLM": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def immutable_field(self) -> bool:
        return self.status == 422 and (
            "field is immutable" in self.message or "Forbidden: updates to" in self.message
        )


@dataclass(frozen=True)
class Credentials:
    host: str
    ssl_context: ssl.SSLContext | bool
    configuration: Any  # kubernetes.client.Configuration (its refresh hook renews rotating tokens)

    def authorization(self) -> str | None:
        cfg = self.configuration
        if cfg.refresh_api_key_hook is not None:
            cfg.refresh_api_key_hook(cfg)
        token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        if not token:
            return None
        prefix = cfg.api_key_prefix.get("authorization", "")
        return f"{prefix} {token}".strip() if not token.lower().startswith("bearer ") else token


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    cfg = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    context: ssl.SSLContext | bool
    if cfg.verify_ssl:
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
    else:
        context = False
    return Credentials(host=cfg.host.rstrip("/"), ssl_context=context, configuration=cfg)


def object_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeClient:
    def __init__(self, credentials: Credentials, timeout: float = 30, user_agent: str = USER_AGENT) -> None:
        self._credentials = credentials
        self._user_agent = user_agent  # the audit log tells the operator's writes apart by it
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_for_loop(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._credentials.ssl_context, limit=32)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type, "User-Agent": self._user_agent}
        authorization = self._credentials.authorization()
        if authorization:
            headers["Authorization"] = authorization
        data = None if body is None else json.dumps(body)
        session = self._session_for_loop()
        async with session.request(
            method, self._credentials.host + path, params=params, data=data, headers=headers
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise _api_error(response.status, text)
            return dict(json.loads(text)) if text else {}

    # ---- children ----

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: the operator owns every field it sets, and only those."""
        meta = obj["metadata"]
        params = {"fieldManager": FIELD_MANAGER, "force": "true", "fieldValidation": "Strict"}
        return await self.request(
            "PATCH",
            object_path(obj["kind"], meta["namespace"], meta["name"]),
            params=params,
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST: for objects written once and never read back (the auth Secret: create-only RBAC)."""
        meta = obj["metadata"]
        return await self.request(
            "POST",
            object_path(obj["kind"], meta["namespace"]),
            body=obj,
            params={"fieldValidation": "Strict"},
        )

    async def delete(
        self, kind: str, namespace: str, name: str, uid: str | None = None, propagation: str = "Background"
    ) -> None:
        """Delete one object; `propagation` "Orphan" keeps its dependents (pods) running."""
        body: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": propagation,
        }
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", object_path(kind, namespace, name), body=body)
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    async def list_at(
        self, kind: str, label_selector: str, namespace: str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """The items and the list's resourceVersion (the moment the list was taken)."""
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        result = await self.request("GET", path, params={"labelSelector": label_selector})
        items: list[dict[str, Any]] = result.get("items", [])
        for item in items:  # list items carry no kind or apiVersion; the plan compares both
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", result.get("apiVersion", ""))
        return items, str(result.get("metadata", {}).get("resourceVersion", ""))

    async def list(
        self, kind: str, label_selector: str, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        return (await self.list_at(kind, label_selector, namespace))[0]

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", object_path(kind, namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    # ---- the custom resource ----

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self.request(
            "PATCH",
            object_path("DisaggregatedLLM", namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
            params={"fieldManager": FIELD_MANAGER},
        )

    async def latest_event(self, namespace: str, kind: str, name: str, reason: str) -> dict[str, Any] | None:
        """The most recent Event of `reason` about one object, or None."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name},reason={reason}"
        result = await self.request(
            "GET", object_path("Event", namespace), params={"fieldSelector": selector}
        )
        events: list[dict[str, Any]] = result.get("items", [])

        def stamp(event: dict[str, Any]) -> str:
            return str(event.get("lastTimestamp") or event.get("eventTime") or "")

        return max(events, key=stamp, default=None)

    async def create_event(self, event: dict[str, Any]) -> None:
        await self.request("POST", object_path("Event", event["metadata"]["namespace"]), body=event)

    # ---- leases (leader election) ----

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.get("Lease", namespace, name)

    async def create_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", object_path("Lease", lease["metadata"]["namespace"]), body=lease)

    async def replace_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        meta = lease["metadata"]
        return await self.request("PUT", object_path("Lease", meta["namespace"], meta["name"]), body=lease)


def _api_error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
        return ApiError(status, str(payload.get("reason", "")), str(payload.get("message", text)))
    except json.JSONDecodeError:
        return ApiError(status, "", text[:500])
