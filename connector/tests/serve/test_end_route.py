"""POST /v1/dllm/end_transfer (security review M2): the router's end reaches decode's own side channel,
so prefill's waiting send ends within the transfer timeout instead of the hold; bad requests end nothing.

The middleware runs in front of a tiny ASGI app standing in for vLLM's (`fake_engine_app`: a TEST DOUBLE,
the real vLLM app is in test_end_route_real_vllm.py), over httpx's ASGI transport. Decode's side channel
is a real KVReceiver and prefill a real KVSender over real Mooncake transports on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import torch

from dllm_connector.end_route import (
    END_PATH,
    MAX_BODY,
    EndRouteConfigError,
    EndTarget,
    EndTransferRoute,
    Message,
    Receive,
    Scope,
    Send,
)
from dllm_connector.end_route_names import END_ROUTE_MIDDLEWARE
from dllm_connector.layout import Geometry, PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.sidechannel import PeerAuth

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

HOST = "127.0.0.1"
TIMEOUT_MS = 2000  # transfer_timeout_ms of both sides and of the route
TIMEOUT = TIMEOUT_MS / 1000
HOLD_SECONDS = 60  # hold_seconds: every bound below is far under it
HOLD = float(HOLD_SECONDS)
HASH = prompt_hash([1, 2, 3])
API_KEY = "engine-key-0123456789abcdef"
TOKEN = "side-channel-token-0123456789abcdef"
GEOMETRY = Geometry(block_size=16, num_kv_heads=2, head_dim=64, model="tiny-end-route")
NUM_BLOCKS = 16
TID = "client-req-7-0-0123456789ab"  # new_transfer_id's shape: <request id>-<index>-<12 hex>


def _caches() -> dict[str, torch.Tensor]:
    shape = (NUM_BLOCKS, GEOMETRY.num_kv_heads, GEOMETRY.block_size, 2 * GEOMETRY.head_dim)
    return {f"model.layers.{i}.self_attn": torch.ones(shape, dtype=torch.bfloat16) for i in range(2)}


def _config() -> PipeConfig:
    return PipeConfig().with_extra(
        buffer_size_gb=gb(8 << 20),
        transfer_timeout_ms=TIMEOUT_MS,
        prefill_wait_ms=HOLD_SECONDS * 1000,
        hold_seconds=HOLD_SECONDS,
    )


@pytest.fixture(scope="module")
def transports() -> Iterator[tuple[MooncakeTransport, MooncakeTransport]]:
    saved = os.environ.get("MC_TCP_BIND_ADDRESS")
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST  # Mooncake binds the first LAN address unless told
    decode, prefill = MooncakeTransport(HOST), MooncakeTransport(HOST)
    yield decode, prefill
    decode.close()
    prefill.close()
    if saved is None:
        os.environ.pop("MC_TCP_BIND_ADDRESS", None)
    else:
        os.environ["MC_TCP_BIND_ADDRESS"] = saved


@pytest.fixture
def receiver(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVReceiver]:
    auth = PeerAuth.from_token(TOKEN)
    receiver = KVReceiver(
        transports[0], PagedKV(_caches(), NUM_BLOCKS, GEOMETRY), _config(), HOST, 0, auth=auth
    )
    yield receiver
    receiver.close()


@pytest.fixture
def sender(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVSender]:
    auth = PeerAuth.from_token(TOKEN)
    sender = KVSender(transports[1], PagedKV(_caches(), NUM_BLOCKS, GEOMETRY), _config(), auth=auth)
    yield sender
    assert sender.close(timeout=30)


class FakeEngineApp:
    """TEST DOUBLE of vLLM's ASGI app: answers 200 with the path and body it got, and records them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.seen.append((scope["method"], scope["path"], body))
        payload = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _target(port: int, *, tp_size: int = 1, api_keys: tuple[str, ...] = (API_KEY,)) -> EndTarget:
    return EndTarget(HOST, port, tp_size, TIMEOUT, auth=PeerAuth.from_token(TOKEN), api_keys=api_keys)


@pytest.fixture
async def engine(receiver: KVReceiver) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngineApp]]:
    inner = FakeEngineApp()
    app = EndTransferRoute(inner, _target(receiver.port))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as client:
        yield client, inner


def _authorized(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", **extra}


async def _until(condition: Callable[[], bool], within: float, what: str) -> None:
    """Wait for `condition`, checked on every turn of the event loop (the app's tasks run meanwhile),
    failing the test past `within` seconds."""
    try:
        async with asyncio.timeout(within):
            while not condition():  # noqa: ASYNC110  # one loop turn per check, no fixed delay
                await asyncio.sleep(0)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for {what}") from None


async def _outcome(sender: KVSender, tid: str, within: float) -> str | None:
    """The send's outcome once it has one (fails the test past `within` seconds)."""
    outcomes: dict[str, str | None] = {}

    def ended() -> bool:
        outcomes.update(sender.finished())
        return tid in outcomes

    await _until(ended, within, f"the send of {tid} to end")
    return outcomes[tid]


async def _waiting(sender: KVSender, receiver: KVReceiver, tid: str) -> float:
    started = time.monotonic()
    sender.submit(SendJob(tid, (1, 2), HOST, receiver.port, HASH))
    await _until(lambda: tid in sender.in_flight, 5, f"the send of {tid} to wait for decode")
    return started


async def test_an_end_ends_prefills_waiting_send_within_the_transfer_timeout(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver, sender: KVSender
) -> None:
    client, inner = engine
    started = await _waiting(sender, receiver, TID)
    answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=_authorized())
    assert answer.status_code == 204, answer.text
    assert answer.content == b""
    outcome = await _outcome(sender, TID, 3 * TIMEOUT)
    assert time.monotonic() - started < 3 * TIMEOUT  # not HOLD
    assert outcome is not None
    assert "not awaited any more" in outcome
    assert inner.seen == []  # the route never reaches vLLM's app


async def test_an_id_ended_before_prefill_offers_is_refused_at_once(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver, sender: KVSender
) -> None:
    client, _ = engine
    answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=_authorized())
    assert answer.status_code == 204
    started = await _waiting(sender, receiver, TID)
    outcome = await _outcome(sender, TID, 3 * TIMEOUT)
    assert outcome is not None
    assert "not awaited any more" in outcome
    assert time.monotonic() - started < 3 * TIMEOUT


async def test_every_other_request_reaches_the_engine_untouched(
    engine: tuple[httpx.AsyncClient, FakeEngineApp],
) -> None:
    client, inner = engine
    body = '{"prompt": "hi",   "max_tokens": 3}'
    completions = await client.post("/v1/completions", content=body, headers=_authorized())
    models = await client.get("/v1/models")
    near = await client.post(END_PATH + "x", content=b"not json")
    assert [r.status_code for r in (completions, models, near)] == [200, 200, 200]
    assert completions.json() == {"path": "/v1/completions", "body": body}  # byte for byte
    assert [(m, p) for m, p, _ in inner.seen] == [
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("POST", END_PATH + "x"),
    ]
    assert inner.seen[2][2] == b"not json"


BAD_BODIES = [
    (b"not json", 400, "must be JSON"),
    (b"\xff\xfe", 400, "must be JSON"),
    (b"[" * 600 + b"]" * 600, 413, f"at most {MAX_BODY} bytes"),
    (b"[" * 500 + b"]" * 500, 400, "one key"),
    (b'["' + TID.encode() + b'"]', 400, "one key"),
    (b"{}", 400, "one key"),
    (json.dumps({"transfer_id": TID, "more": 1}).encode(), 400, "one key"),
    (json.dumps({"transfer_id": 7}).encode(), 400, "transfer_id must be"),
    (json.dumps({"transfer_id": "no-shape"}).encode(), 400, "transfer_id must be"),
    (json.dumps({"transfer_id": "a b-0-0123456789ab"}).encode(), 400, "transfer_id must be"),
    (json.dumps({"transfer_id": "x" * 300 + "-0-0123456789ab"}).encode(), 400, "transfer_id must be"),
    (json.dumps({"transfer_id": "x-0-0123456789AB"}).encode(), 400, "transfer_id must be"),
    (json.dumps({"transfer_id": TID + "\n"}).encode(), 400, "transfer_id must be"),
    (b'{"transfer_id": "' + b"x" * 2000 + b'"}', 413, f"at most {MAX_BODY} bytes"),
]


async def test_bad_requests_get_a_clear_4xx_and_end_nothing(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver, sender: KVSender
) -> None:
    client, inner = engine
    await _waiting(sender, receiver, TID)
    for body, status, reason in BAD_BODIES:
        answer = await client.post(END_PATH, content=body, headers=_authorized())
        assert answer.status_code == status, (body[:40], answer.text)
        error = answer.json()["error"]
        assert reason in error["message"], (body[:40], error)
        assert error["code"] == status
        assert "Traceback" not in answer.text
    unauthorized = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Bearer {API_KEY}x"},
    ]
    for headers in unauthorized:
        answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=headers)
        assert answer.status_code == 401, headers
        assert answer.json()["error"]["message"] == "Unauthorized"
    wrong_method = await client.get(END_PATH, headers=_authorized())
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert sender.in_flight == {TID}  # none of them ended it
    assert sender.finished() == {}
    assert inner.seen == []
    answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=_authorized())
    assert answer.status_code == 204  # and the good one still does
    assert await _outcome(sender, TID, 3 * TIMEOUT) is not None


async def test_a_body_that_keeps_coming_is_cut_at_the_limit(receiver: KVReceiver) -> None:
    """No Content-Length, chunks without end: refused after MAX_BODY bytes, the rest never read."""
    app = EndTransferRoute(FakeEngineApp(), _target(receiver.port, api_keys=()))
    reads = 0

    async def receive() -> Message:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": END_PATH, "headers": []}
    await asyncio.wait_for(app(scope, receive, send), 5)
    assert sent[0]["status"] == 413
    assert reads == MAX_BODY // 100 + 1


async def test_without_an_engine_key_no_authorization_is_needed(
    receiver: KVReceiver, sender: KVSender
) -> None:
    app = EndTransferRoute(FakeEngineApp(), _target(receiver.port, api_keys=()))
    await _waiting(sender, receiver, TID)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
        answer = await client.post(END_PATH, json={"transfer_id": TID})
    assert answer.status_code == 204
    assert "not awaited any more" in str(await _outcome(sender, TID, 3 * TIMEOUT))


@contextlib.contextmanager
def _bound_not_listening(port: int) -> Iterator[bool]:
    """Holds `port` bound without listening, so a connection to it is refused and no other server can
    take it meanwhile; yields False where it is already taken."""
    with socket.socket() as holder:
        try:
            holder.bind((HOST, port))
        except OSError:
            yield False
            return
        yield True


@contextlib.contextmanager
def _two_refusing_ports() -> Iterator[int]:
    """The first of two consecutive ports held bound and not listening (TP ranks 0 and 1)."""
    while True:
        with socket.socket() as first:
            first.bind((HOST, 0))
            port = int(first.getsockname()[1])
            with _bound_not_listening(port + 1) as held:
                if held:
                    yield port
                    return


async def test_a_side_channel_that_does_not_answer_is_a_502_naming_the_rank() -> None:
    with _two_refusing_ports() as port:
        app = EndTransferRoute(FakeEngineApp(), _target(port, tp_size=2))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
            started = time.monotonic()
            answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=_authorized())
    assert answer.status_code == 502
    message = answer.json()["error"]["message"]
    assert "rank 0: cannot end transfer" in message
    assert "rank 1: cannot end transfer" in message
    assert time.monotonic() - started < 3 * TIMEOUT


async def test_every_tp_rank_is_told(receiver: KVReceiver, sender: KVSender) -> None:
    """TP 2 where only rank 0 listens: rank 0's send ends, and the 502 names rank 1 alone."""
    app = EndTransferRoute(FakeEngineApp(), _target(receiver.port, tp_size=2))
    with _bound_not_listening(receiver.port + 1) as held:
        if not held:  # another listener has it: rank 1 might answer
            pytest.skip(f"port {receiver.port + 1} is in use by another listener")
        await _waiting(sender, receiver, TID)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
            answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=_authorized())
    message = answer.json()["error"]["message"]
    assert "rank 1: cannot end transfer" in message
    assert "rank 0" not in message
    assert "not awaited any more" in str(await _outcome(sender, TID, 3 * TIMEOUT))


def _env(**changes: str) -> dict[str, str]:
    env = {
        "VLLM_KV_CONNECTOR": "mooncake",
        "VLLM_KV_ROLE": "decode",
        "VLLM_KV_LISTEN_PORT": "50051",
        "VLLM_KV_TRANSFER_TIMEOUT_MS": "1500",
        "VLLM_HOST_IP": "10.0.0.6",
        "DLLM_END_ROUTE_TP_SIZE": "4",
        "VLLM_API_KEY": API_KEY,
        "DLLM_KV_AUTH_TOKEN": TOKEN,
    }
    return {**env, **changes}


def test_the_target_comes_from_the_engines_env() -> None:
    target = EndTarget.from_env(_env())
    assert (target.host, target.port, target.tp_size, target.timeout_s) == ("10.0.0.6", 50051, 4, 1.5)
    assert target.api_keys == (API_KEY,)
    assert target.auth == PeerAuth.from_token(TOKEN)
    bare = EndTarget.from_env({k: v for k, v in _env().items() if k.startswith("VLLM_KV_")})
    assert (bare.host, bare.tp_size, bare.api_keys, bare.auth) == ("127.0.0.1", 1, (), None)
    flagged = EndTarget.from_env(_env(DLLM_END_ROUTE_API_KEY="flag-key-1\nflag-key-2"))
    assert flagged.api_keys == ("flag-key-1", "flag-key-2")  # vLLM's --api-key wins over VLLM_API_KEY


@pytest.mark.parametrize("size", ["0", "-1", "two", "100000"])
def test_a_bad_tp_size_in_the_env_names_the_variable(size: str) -> None:
    with pytest.raises(EndRouteConfigError, match="DLLM_END_ROUTE_TP_SIZE"):
        EndTarget.from_env(_env(DLLM_END_ROUTE_TP_SIZE=size))


def test_vllm_builds_it_from_the_app_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's --middleware calls app.add_middleware(cls): the class takes the app only, env for the rest."""
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    route: Any = EndTransferRoute(FakeEngineApp())
    assert route.target.port == 50051


async def test_behind_vllms_root_path_the_route_is_still_served(
    receiver: KVReceiver, sender: KVSender
) -> None:
    inner = FakeEngineApp()
    app = EndTransferRoute(inner, _target(receiver.port))
    await _waiting(sender, receiver, TID)
    transport = httpx.ASGITransport(app=app, root_path="/proxy")
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        answer = await client.post("/proxy" + END_PATH, json={"transfer_id": TID}, headers=_authorized())
        other = await client.get("/proxy/v1/models")
    assert answer.status_code == 204
    assert other.status_code == 200
    assert [p for _, p, _ in inner.seen] == ["/proxy/v1/models"]
    assert "not awaited any more" in str(await _outcome(sender, TID, 3 * TIMEOUT))


async def test_any_of_vllms_keys_is_accepted_and_nothing_else(receiver: KVReceiver) -> None:
    app = EndTransferRoute(FakeEngineApp(), _target(receiver.port, api_keys=("first-key", "second-key")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
        statuses = [
            (
                await client.post(
                    END_PATH, json={"transfer_id": TID}, headers={"Authorization": f"Bearer {k}"}
                )
            ).status_code
            for k in ("first-key", "second-key", "third-key", "first-keysecond-key")
        ]
    assert statuses == [204, 204, 401, 401]


async def test_ends_over_the_bound_get_503_while_a_side_channel_is_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A side channel that accepts and never answers holds one end for the transfer timeout; the next
    is refused at once rather than queued."""
    monkeypatch.setattr("dllm_connector.end_route.MAX_IN_FLIGHT", 1)
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen(8)  # connections complete in the backlog; nothing is ever read or answered
        app = EndTransferRoute(FakeEngineApp(), _target(int(silent.getsockname()[1]), api_keys=()))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://d", timeout=30
        ) as client:
            first = asyncio.create_task(client.post(END_PATH, json={"transfer_id": TID}))
            await _until(lambda: app.in_flight > 0, 10, "the first end to be in flight")
            second = await client.post(END_PATH, json={"transfer_id": TID})
            assert second.status_code == 503
            assert "ends in flight" in second.json()["error"]["message"]
            started = time.monotonic()
            assert (await first).status_code == 502
            assert time.monotonic() - started < 3 * TIMEOUT
    assert app.in_flight == 0


def test_the_path_dllm_serve_gives_vllm_names_this_route() -> None:
    """dllm-serve passes the middleware by name (it never imports the route): the name is this class."""
    assert f"{EndTransferRoute.__module__}.{EndTransferRoute.__qualname__}" == END_ROUTE_MIDDLEWARE
