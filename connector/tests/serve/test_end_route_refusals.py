"""What POST /v1/dllm/end_transfer refuses (security review M2): a malformed or oversized body, a
missing or wrong engine key, a wrong method, a body that never ends, and ends past the in-flight bound
while a side channel is slow; each gets a clear 4xx or 503 and ends nothing.

The middleware runs in front of a TEST DOUBLE of vLLM's app over httpx's ASGI transport, with a real
KVReceiver and KVSender over real Mooncake transports on 127.0.0.1 (end_route_cases.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import end_route_cases
import httpx
import pytest
from e2e.waiting import wait_until_async
from end_route_cases import (
    API_KEY,
    HOST,
    TID,
    TIMEOUT,
    FakeEngineApp,
    authorized,
    end_target,
    send_outcome,
    waiting_send,
)

from dllm_connector.end_route import END_PATH, MAX_BODY, EndTransferRoute
from dllm_connector.key_guard import Message
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

transports = end_route_cases.transports  # the shared fixtures, collected from this module's names
receiver = end_route_cases.receiver
sender = end_route_cases.sender
engine = end_route_cases.engine

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
    await waiting_send(sender, receiver, TID)
    for body, status, reason in BAD_BODIES:
        answer = await client.post(END_PATH, content=body, headers=authorized())
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
    wrong_method = await client.get(END_PATH, headers=authorized())
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert sender.in_flight == {TID}  # none of them ended it
    assert sender.finished() == {}
    assert inner.seen == []
    answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=authorized())
    assert answer.status_code == 204  # and the good one still does
    assert await send_outcome(sender, TID, 3 * TIMEOUT) is not None


async def test_a_body_that_keeps_coming_is_cut_at_the_limit(receiver: KVReceiver) -> None:
    """No Content-Length, chunks without end: refused after MAX_BODY bytes, the rest never read."""
    app = EndTransferRoute(FakeEngineApp(), end_target(receiver.port, api_keys=()))
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


async def test_any_of_vllms_keys_is_accepted_and_nothing_else(receiver: KVReceiver) -> None:
    app = EndTransferRoute(FakeEngineApp(), end_target(receiver.port, api_keys=("first-key", "second-key")))
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
        app = EndTransferRoute(FakeEngineApp(), end_target(int(silent.getsockname()[1]), api_keys=()))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://d", timeout=30
        ) as client:
            first = asyncio.create_task(client.post(END_PATH, json={"transfer_id": TID}))
            await wait_until_async(lambda: app.in_flight > 0, "the first end to be in flight", 10)
            second = await client.post(END_PATH, json={"transfer_id": TID})
            assert second.status_code == 503
            assert "ends in flight" in second.json()["error"]["message"]
            started = time.monotonic()
            assert (await first).status_code == 502
            assert time.monotonic() - started < 3 * TIMEOUT
    assert app.in_flight == 0
