"""The engine key guard (NEW-3) as vLLM's app sees it: an ASGI middleware in front of an app that records
every request it is handed. A request without the key reaches nothing but the probes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dllm_connector.key_guard import EngineKeyGuard, Message, Receive, Scope, Send

KEY = "engine-key-0123456789abcdef"
ENV = {"VLLM_API_KEY": KEY}
# vLLM's routes outside /v1 (vLLM issue 58144), a LoRA load, and one a later vLLM might add.
UNGUARDED_BY_VLLM = [
    "/invocations",
    "/pooling",
    "/tokenize",
    "/detokenize",
    "/score",
    "/classify",
    "/rerank",
    "/v1/load_lora_adapter",
    "/some/route/of/a/later/vllm",
    "/health/",
    "//health",
    "/metrics/../invocations",
]


class Recorder:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append(f"{scope['type']} {scope.get('method', '')} {scope.get('path', '')}")


def call(
    guard: EngineKeyGuard, path: str, *, method: str = "POST", auth: bytes | None = None, kind: str = "http"
) -> list[Message]:
    sent: list[Message] = []
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
    if auth is not None:
        headers.append((b"authorization", auth))
    scope: dict[str, Any] = {"type": kind, "path": path, "root_path": "", "headers": headers}
    if kind == "http":
        scope["method"] = method

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent


@pytest.mark.parametrize("path", UNGUARDED_BY_VLLM)
@pytest.mark.parametrize("auth", [None, b"Bearer wrong-key", b"Basic " + KEY.encode(), b"Bearer", b"bearer"])
def test_without_the_key_every_path_but_the_probes_is_401_and_reaches_nothing(
    path: str, auth: bytes | None
) -> None:
    app = Recorder()
    sent = call(EngineKeyGuard(app, ENV), path, auth=auth)
    assert app.seen == []
    assert sent[0]["status"] == 401
    assert sent[1]["body"] == b'{"error":"Unauthorized"}'


@pytest.mark.parametrize(
    ("path", "method"), [("/health", "POST"), ("/metrics", "DELETE"), ("/health", "OPTIONS")]
)
def test_a_probe_path_is_open_only_to_get_and_head(path: str, method: str) -> None:
    app = Recorder()
    assert call(EngineKeyGuard(app, ENV), path, method=method)[0]["status"] == 401
    assert app.seen == []


@pytest.mark.parametrize(("path", "method"), [("/health", "GET"), ("/health", "HEAD"), ("/metrics", "GET")])
def test_the_probes_need_no_key(path: str, method: str) -> None:
    app = Recorder()
    assert call(EngineKeyGuard(app, ENV), path, method=method) == []
    assert app.seen == [f"http {method} {path}"]


@pytest.mark.parametrize("scheme", [b"Bearer ", b"bearer ", b"BEARER "])
def test_the_key_opens_every_path(scheme: bytes) -> None:
    app = Recorder()
    assert call(EngineKeyGuard(app, ENV), "/invocations", auth=scheme + KEY.encode()) == []
    assert app.seen == ["http POST /invocations"]


def test_any_of_the_api_key_flags_values_opens_and_vllm_api_key_then_does_not() -> None:
    env = {**ENV, "DLLM_END_ROUTE_API_KEY": "flag-key-1\nflag-key-2"}
    app = Recorder()
    guard = EngineKeyGuard(app, env)
    assert call(guard, "/pooling", auth=b"Bearer flag-key-2") == []
    assert call(guard, "/pooling", auth=b"Bearer " + KEY.encode())[0]["status"] == 401
    assert app.seen == ["http POST /pooling"]


def test_a_websocket_without_the_key_is_closed_before_the_app() -> None:
    app = Recorder()
    sent = call(EngineKeyGuard(app, ENV), "/v1/realtime", kind="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008}]
    assert app.seen == []


def test_no_key_configured_lets_everything_through_as_vllm_does() -> None:
    app = Recorder()
    assert call(EngineKeyGuard(app, {}), "/invocations") == []
    assert app.seen == ["http POST /invocations"]


def test_lifespan_reaches_the_app() -> None:
    app = Recorder()
    call(EngineKeyGuard(app, ENV), "", kind="lifespan")
    assert app.seen == ["lifespan  "]
