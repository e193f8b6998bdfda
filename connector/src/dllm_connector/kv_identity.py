"""The engine's KV-compatibility fingerprint on its health answers (issue 34).

The operator gives both roles' pods the same DLLM_KV_FINGERPRINT: a hash of everything that must agree
for KV to move between them (its render/fingerprint.py). This middleware adds it to every answer to
GET or HEAD `/health` as `X-Dllm-Kv-Fingerprint`; the router reads it on the health checks it already
makes, so it pairs only pods that share it with no new request, route, credential or RBAC. The value
is a hash of the deployment's settings, not a secret; `/health` is as open as before.

dllm-serve adds it with vLLM's `--middleware` on both roles when the variable is set (before the key
guard, which stays outermost).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dllm_connector.key_guard import ASGIApp, Message, Receive, Scope, Send, is_probe, request_path
from dllm_contract import kv_fingerprint

HEADER = kv_fingerprint.HEADER.lower().encode()


def fingerprint_of(env: Mapping[str, str]) -> str | None:
    """The engine's fingerprint, when its variable holds one."""
    return kv_fingerprint.valid(env.get(kv_fingerprint.ENV_KV_FINGERPRINT, "").strip())


class KVIdentityHeader:
    """vLLM's `--middleware` calls `app.add_middleware(cls)`: the app only; the value comes from the env."""

    def __init__(self, app: ASGIApp, env: Mapping[str, str] | None = None) -> None:
        self.app = app
        value = fingerprint_of(os.environ if env is None else env)
        self._header = (HEADER, value.encode()) if value is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        header = self._header
        if header is None or not is_probe(scope) or request_path(scope) != "/health":
            await self.app(scope, receive, send)
            return

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, with_header)
