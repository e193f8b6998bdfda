"""Every path of an engine's HTTP port needs the engine key, but the probes (security re-check NEW-3).

vLLM checks its key only on paths under `/v1`; `/invocations` (SageMaker's, mounted always, serving the
same completions), `/pooling`, `/tokenize`, `/score`, `/classify`, `/rerank` and whatever route a later
vLLM adds stay open to anyone who reaches the port. This middleware denies by default: a request
without a valid `Authorization: Bearer <key>` gets 401 on every path but GET or HEAD of `/health` (the
kubelet's probes) and `/metrics` (Prometheus), HTTP and websocket alike. With no key configured it
lets everything through, as vLLM does.

dllm-serve adds it with vLLM's `--middleware` on both roles, after every other middleware flag, so it
runs first (vLLM adds middlewares in order, and the last added is the outermost).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from dllm_connector.end_route_names import ENV_END_ROUTE_API_KEY

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ENV_API_KEY = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})
OPEN_METHODS = frozenset({"GET", "HEAD"})
_DENIED = b'{"error":"Unauthorized"}'
_WEBSOCKET_POLICY_VIOLATION = 1008


def engine_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    """The keys vLLM itself accepts: its --api-key values (dllm-serve hands them over, one per line),
    else VLLM_API_KEY; none when neither is set."""
    from_flag = tuple(k for k in env.get(ENV_END_ROUTE_API_KEY, "").split("\n") if k)
    if from_flag:
        return from_flag
    key = env.get(ENV_API_KEY)
    return (key,) if key else ()


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def presented_key(scope: Scope) -> bytes | None:
    """The bearer token of the request's Authorization header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token if scheme.lower() == b"bearer" and token else None
    return None


def request_path(scope: Scope) -> str:
    """The request's path, vLLM's --root-path taken off."""
    return str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))


def is_probe(scope: Scope) -> bool:
    return (
        scope["type"] == "http" and scope.get("method") in OPEN_METHODS and request_path(scope) in OPEN_PATHS
    )


class EngineKeyGuard:
    """vLLM's `--middleware` calls `app.add_middleware(cls)`: the app only; the keys come from the env."""

    def __init__(self, app: ASGIApp, env: Mapping[str, str] | None = None) -> None:
        self.app = app
        self._digests = tuple(_digest(k.encode()) for k in engine_keys(os.environ if env is None else env))

    def allows(self, scope: Scope) -> bool:
        if not self._digests or is_probe(scope):
            return True
        key = presented_key(scope)
        if key is None:
            return False
        offered = _digest(key)
        matched = False
        for digest in self._digests:  # every key compared, in constant time
            matched |= secrets.compare_digest(offered, digest)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": _WEBSOCKET_POLICY_VIOLATION})
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(_DENIED)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _DENIED})
