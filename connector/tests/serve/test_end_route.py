"""POST /v1/dllm/end_transfer (security review M2): the router's end reaches decode's own side channel,
so prefill's waiting send ends within the transfer timeout instead of the hold, also for an id ended
before prefill offers it, without an engine key, and behind vLLM's root path; every other request
reaches vLLM's app untouched.

The middleware runs in front of a TEST DOUBLE of vLLM's app over httpx's ASGI transport, with a real
KVReceiver and KVSender over real Mooncake transports on 127.0.0.1 (end_route_cases.py).
"""

from __future__ import annotations

import time

import end_route_cases
import httpx
import pytest
from end_route_cases import (
    TID,
    TIMEOUT,
    FakeEngineApp,
    authorized,
    end_target,
    send_outcome,
    submit_send,
    waiting_send,
)

from dllm_connector.end_route import END_PATH, EndTransferRoute
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

transports = end_route_cases.transports  # the shared fixtures, collected from this module's names
receiver = end_route_cases.receiver
sender = end_route_cases.sender
engine = end_route_cases.engine


async def test_an_end_ends_prefills_waiting_send_within_the_transfer_timeout(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver, sender: KVSender
) -> None:
    client, inner = engine
    started = await waiting_send(sender, receiver, TID)
    answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=authorized())
    assert answer.status_code == 204, answer.text
    assert answer.content == b""
    outcome = await send_outcome(sender, TID, 3 * TIMEOUT)
    assert time.monotonic() - started < 3 * TIMEOUT  # not HOLD
    assert outcome is not None
    assert "not awaited any more" in outcome
    assert inner.seen == []  # the route never reaches vLLM's app


async def test_an_id_ended_before_prefill_offers_is_refused_at_once(
    engine: tuple[httpx.AsyncClient, FakeEngineApp], receiver: KVReceiver, sender: KVSender
) -> None:
    client, _ = engine
    answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=authorized())
    assert answer.status_code == 204
    # Not waited for as in flight: refused at its offer, the send may end before a poll sees it.
    started = submit_send(sender, receiver, TID)
    outcome = await send_outcome(sender, TID, 3 * TIMEOUT)
    assert outcome is not None
    assert "not awaited any more" in outcome
    assert time.monotonic() - started < 3 * TIMEOUT


async def test_every_other_request_reaches_the_engine_untouched(
    engine: tuple[httpx.AsyncClient, FakeEngineApp],
) -> None:
    client, inner = engine
    body = '{"prompt": "hi",   "max_tokens": 3}'
    completions = await client.post("/v1/completions", content=body, headers=authorized())
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


async def test_without_an_engine_key_no_authorization_is_needed(
    receiver: KVReceiver, sender: KVSender
) -> None:
    app = EndTransferRoute(FakeEngineApp(), end_target(receiver.port, api_keys=()))
    await waiting_send(sender, receiver, TID)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
        answer = await client.post(END_PATH, json={"transfer_id": TID})
    assert answer.status_code == 204
    assert "not awaited any more" in str(await send_outcome(sender, TID, 3 * TIMEOUT))


async def test_behind_vllms_root_path_the_route_is_still_served(
    receiver: KVReceiver, sender: KVSender
) -> None:
    inner = FakeEngineApp()
    app = EndTransferRoute(inner, end_target(receiver.port))
    await waiting_send(sender, receiver, TID)
    transport = httpx.ASGITransport(app=app, root_path="/proxy")
    async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
        answer = await client.post("/proxy" + END_PATH, json={"transfer_id": TID}, headers=authorized())
        other = await client.get("/proxy/v1/models")
    assert answer.status_code == 204
    assert other.status_code == 200
    assert [p for _, p, _ in inner.seen] == ["/proxy/v1/models"]
    assert "not awaited any more" in str(await send_outcome(sender, TID, 3 * TIMEOUT))
