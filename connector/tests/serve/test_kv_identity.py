"""The KV fingerprint on an engine's health answers (kv_identity.py, issue 34): added to GET and HEAD
/health only, never to another path, and only when the operator gave the pod a well-formed value;
dllm-serve adds the middleware on both roles, inside the key guard."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from dllm_connector import serve
from dllm_connector.key_guard import Message, Receive, Scope, Send
from dllm_connector.kv_identity import HEADER, KVIdentityHeader

if TYPE_CHECKING:
    from conftest import Engine  # the serve tests' own conftest (a fixture's type only)

FINGERPRINT = "6236b2124c"


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b""})


def headers_of(middleware: KVIdentityHeader, path: str, method: str = "GET") -> list[tuple[bytes, bytes]]:
    sent: list[Message] = []
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return list(sent[0]["headers"])


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_health_answers_carry_the_fingerprint(method: str) -> None:
    middleware = KVIdentityHeader(ok, {"DLLM_KV_FINGERPRINT": FINGERPRINT})
    assert (HEADER, FINGERPRINT.encode()) in headers_of(middleware, "/health", method)


@pytest.mark.parametrize(
    ("path", "method"), [("/metrics", "GET"), ("/v1/models", "GET"), ("/health", "POST")]
)
def test_no_other_answer_carries_it(path: str, method: str) -> None:
    middleware = KVIdentityHeader(ok, {"DLLM_KV_FINGERPRINT": FINGERPRINT})
    assert HEADER not in dict(headers_of(middleware, path, method))


@pytest.mark.parametrize("value", ["", "6236B2124C", "abc\r\nx-evil: 1", "f" * 65])
def test_a_missing_or_malformed_value_adds_nothing(value: str) -> None:
    middleware = KVIdentityHeader(ok, {"DLLM_KV_FINGERPRINT": value})
    assert HEADER not in dict(headers_of(middleware, "/health"))


def test_dllm_serve_adds_it_inside_the_key_guard_where_the_pod_has_a_fingerprint(
    seed_prefill: Engine, seed_decode: Engine
) -> None:
    def middlewares(engine: Engine, env: dict[str, str]) -> list[str]:
        command = serve.build_command(
            env, engine.args, serve.Launcher.API_SERVER, hostname="h", boot_id="b", python="python3"
        )
        return [command.argv[i + 1] for i, a in enumerate(command.argv) if a == "--middleware"]

    for engine in (seed_prefill, seed_decode):
        assert middlewares(engine, {**engine.env, "DLLM_KV_FINGERPRINT": FINGERPRINT})[-2:] == [
            "dllm_connector.kv_identity.KVIdentityHeader",
            "dllm_connector.key_guard.EngineKeyGuard",
        ]
        assert "dllm_connector.kv_identity.KVIdentityHeader" not in middlewares(engine, engine.env)
