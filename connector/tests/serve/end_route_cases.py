"""What the POST /v1/dllm/end_transfer tests share: decode's side channel as a real KVReceiver and
prefill as a real KVSender over real Mooncake transports on 127.0.0.1, a TEST DOUBLE of vLLM's ASGI app
(`FakeEngineApp`; the real vLLM app is in test_end_route_real_vllm.py) with the route in front of it
over httpx's ASGI transport, and ways to wait for prefill's send to wait or end.

A test module collects a fixture by binding it to a name of its own: `engine = end_route_cases.engine`
(and each fixture it depends on: `receiver`, `sender`, `transports`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import torch
from e2e.waiting import wait_until_async

from dllm_connector.end_route import EndTarget, EndTransferRoute
from dllm_connector.key_guard import Receive, Scope, Send
from dllm_connector.layout import Geometry, PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.sidechannel import PeerAuth

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


def caches() -> dict[str, torch.Tensor]:
    shape = (NUM_BLOCKS, GEOMETRY.num_kv_heads, GEOMETRY.block_size, 2 * GEOMETRY.head_dim)
    return {f"model.layers.{i}.self_attn": torch.ones(shape, dtype=torch.bfloat16) for i in range(2)}


def pipe_config() -> PipeConfig:
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
        transports[0], PagedKV(caches(), NUM_BLOCKS, GEOMETRY), pipe_config(), HOST, 0, auth=auth
    )
    yield receiver
    receiver.close()


@pytest.fixture
def sender(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVSender]:
    auth = PeerAuth.from_token(TOKEN)
    sender = KVSender(transports[1], PagedKV(caches(), NUM_BLOCKS, GEOMETRY), pipe_config(), auth=auth)
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


def end_target(port: int, *, tp_size: int = 1, api_keys: tuple[str, ...] = (API_KEY,)) -> EndTarget:
    return EndTarget(HOST, port, tp_size, TIMEOUT, auth=PeerAuth.from_token(TOKEN), api_keys=api_keys)


@pytest.fixture
async def engine(receiver: KVReceiver) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngineApp]]:
    inner = FakeEngineApp()
    app = EndTransferRoute(inner, end_target(receiver.port))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://decode") as client:
        yield client, inner


def authorized(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", **extra}


async def send_outcome(sender: KVSender, tid: str, within: float) -> str | None:
    """The send's outcome once it has one (fails the test past `within` seconds)."""
    outcomes: dict[str, str | None] = {}

    def ended() -> bool:
        outcomes.update(sender.finished())
        return tid in outcomes

    await wait_until_async(ended, f"the send of {tid} to end", within)
    return outcomes[tid]


def submit_send(sender: KVSender, receiver: KVReceiver, tid: str) -> float:
    """Submit prefill's send of `tid` to the receiver; returns when it was submitted."""
    started = time.monotonic()
    sender.submit(SendJob(tid, (1, 2), HOST, receiver.port, HASH))
    return started


async def waiting_send(sender: KVSender, receiver: KVReceiver, tid: str) -> float:
    """Submit prefill's send of `tid` and return when it waits for decode (its start time)."""
    started = submit_send(sender, receiver, tid)
    await wait_until_async(lambda: tid in sender.in_flight, f"the send of {tid} to wait for decode", 5)
    return started
