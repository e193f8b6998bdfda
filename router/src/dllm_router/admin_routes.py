"""The routes besides generation: /v1/models (a decode pod's own answer), /health, /ready, /metrics."""

from __future__ import annotations

from typing import Any

import aiohttp
import prometheus_client

from dllm_router import openai as oa
from dllm_router.engine_auth import EngineAuth
from dllm_router.errors import RouterError, request_id, request_id_or_new
from dllm_router.exchange import ExchangeHost
from dllm_router.http_messages import Request, Response
from dllm_router.metrics import exposition
from dllm_router.pod_watch import PodWatch

JsonObject = dict[str, Any]


class AdminRoutes:
    def __init__(self, host: ExchangeHost, pods: PodWatch, auth: EngineAuth) -> None:
        self._host, self._pods, self._auth = host, pods, auth
        self._exposition = exposition(host.metrics, lambda: (host.prefill, host.decode))

    async def models(self, request: Request) -> Response:
        host = self._host
        try:
            rid = request_id(request)
        except RouterError as e:  # a malformed id is the client's 400 here too (NEW-8), never a traceback
            return host.error_response(e, request_id_or_new(None))
        try:
            ep = host.pick(host.decode, [])
            headers = self._auth.models_headers(request)  # L5: the engines' key, else the client's own
            try:
                url = ep.url + "/v1/models"
                timeout = self._pods.probe_timeout
                async with self._pods.session.get(url, timeout=timeout, headers=headers) as r:
                    return Response(await r.read(), status=r.status)
            except (TimeoutError, aiohttp.ClientError) as e:
                raise RouterError(502, "decode_unreachable", f"decode pod {ep.name}: {e!r}") from e
        except RouterError as e:
            return host.error_response(e, rid)

    def _pool_state(self) -> JsonObject:
        return {
            pool.role: {"ready": len(pool.ready()), "pods": len(pool.endpoints)}
            for pool in (self._host.prefill, self._host.decode)
        }

    async def health(self, _: Request) -> Response:
        """Liveness: the router itself is up (200), with each role's ready and known pods."""
        state = self._pool_state()
        ok = all(role["ready"] for role in state.values())
        status = "ok" if ok else "degraded"
        return Response(oa.dumps({"status": status, "flow": self._host.config.flow, **state}))

    async def ready(self, _: Request) -> Response:
        """Readiness: 200 only when both roles have a ready pod; else 503 naming the missing roles."""
        state = self._pool_state()
        missing = [role for role, s in state.items() if not s["ready"]]
        if missing:
            message = "no ready " + " or ".join(missing) + " pod"
            return Response(oa.error_body(message, "service_unavailable", 503), status=503)
        return Response(oa.dumps({"status": "ok", **state}))

    async def metrics_page(self, _: Request) -> Response:
        return Response(self._exposition(), content_type=prometheus_client.CONTENT_TYPE_LATEST)
