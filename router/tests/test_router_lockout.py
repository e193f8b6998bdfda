"""NEW-5: the connection cap is no lockout. A connection that never begins a request is closed at the
first-byte deadline; at the cap a new connection takes the slot of the longest-idle one (silent since
it opened, idle between requests, or closing), and only connections with a request in progress keep
theirs. In-process, over raw sockets, against engine doubles."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from raw_client import RawClient, completion, post
from router_engine_double import expected_text
from router_harness import EngineFactory, RouterFactory, RunningRouter, wait_until

pytestmark = pytest.mark.timeout(30)
FIRST_BYTE_S = 1.5  # long enough that 'served before it' holds on two loaded cores
HEAD_S = 3.0


async def lockout_router(engines: EngineFactory, start_router: RouterFactory, cap: int) -> RunningRouter:
    p, d = await engines("p0"), await engines("d0")
    return await start_router(
        "dllm", [p], [d], max_connections=cap, head_timeout_s=HEAD_S, first_byte_timeout_s=FIRST_BYTE_S
    )


async def generate(r: RunningRouter, prompt: str) -> int:
    """One generation request on a new connection; its status (the text is checked when 200)."""
    c = await RawClient.to(r)
    try:
        c.send(post(completion(prompt, 3), extra=b"Connection: close\r\n"))
        answer = await c.answer()
    finally:
        c.close()
    if answer.status == 200:
        assert json.loads(answer.body)["choices"][0]["text"] == expected_text(prompt, 3)
    return answer.status


async def test_a_silent_connection_is_closed_at_the_first_byte_deadline_and_an_idle_one_is_kept(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await lockout_router(engines, start_router, cap=8)
    kept = await RawClient.to(r)
    kept.send(post(completion("k", 2)))
    assert (await kept.answer()).status == 200  # now idle between requests: keep-alive's 75 s apply
    silent = await RawClient.to(r)
    started = time.monotonic()
    assert await silent.closed_by_server()
    took = time.monotonic() - started
    assert FIRST_BYTE_S * 0.9 <= took <= FIRST_BYTE_S + FIRST_BYTE_S / 4 + 1.0  # deadline + sweep + slack
    kept.send(post(completion("again", 2)))
    assert (await kept.answer()).status == 200  # past the first-byte deadline, still open


async def test_silent_sockets_reopened_at_the_cap_do_not_keep_a_real_request_out(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    """The attack: --max-connections silent sockets, each re-opened as soon as the router closes it.
    Real requests are served well within the first-byte deadline (a 503 is possible only while every
    silent socket is younger than the eviction grace, so the client retries), every silent socket
    goes by that deadline, and the router never holds more than the cap."""
    cap = 6
    r = await lockout_router(engines, start_router, cap=cap)
    all_open = asyncio.Event()  # every attacker connected once
    opened = 0
    lived: list[float] = []
    most = 0

    async def hold_a_slot() -> None:
        nonlocal opened
        while True:
            c = await RawClient.to(r)
            at = time.monotonic()
            opened += 1
            if opened == cap:
                all_open.set()
            try:
                assert await c.closed_by_server()
            finally:
                c.close()
            lived.append(time.monotonic() - at)

    attackers = [asyncio.ensure_future(hold_a_slot()) for _ in range(cap)]
    try:
        await asyncio.wait_for(all_open.wait(), HEAD_S)
        await wait_until(lambda: len(r.server.connections) == cap, "every slot taken by a silent socket")
        for i in range(5):
            started = time.monotonic()
            while (status := await generate(r, f"real {i}")) == 503:
                most = max(most, len(r.server.connections))
            assert status == 200
            assert time.monotonic() - started < FIRST_BYTE_S  # no silent socket had to time out first
            most = max(most, len(r.server.connections))
    finally:
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
    # Only the first real request is sure to meet a full cap (awaited above). A later one may find a
    # slot freed by a silent socket's deadline, or by the request before it, ahead of the evicted
    # attacker's reconnection.
    assert r.server.evicted_connections >= 1
    assert most <= cap
    assert max(lived) <= FIRST_BYTE_S + FIRST_BYTE_S / 4 + 1.0


async def test_connections_with_a_request_in_progress_are_never_evicted(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    """At the cap with every connection mid-request (answers held at the engine, or a body still to
    come), a new connection gets 503 and every one of them is answered in full afterwards."""
    p, d = await engines("p0"), await engines("d0")
    d.hold = asyncio.Event()
    r = await start_router("dllm", [p], [d], max_connections=4, first_byte_timeout_s=FIRST_BYTE_S)
    waiting = [await RawClient.to(r) for _ in range(3)]
    for i, c in enumerate(waiting):
        c.send(post(completion(f"w{i}", 2)))
    await wait_until(lambda: len(d.generations) == 3, "three answers held at decode")
    uploading = await RawClient.to(r)
    body = completion("u", 2)
    head = post(body)[: -len(body)]
    uploading.send(head[:-2] + b"Expect: 100-continue\r\n\r\n")
    assert await uploading.head() == (100, {})  # its head is read: a request in progress

    extra = await RawClient.to(r)
    extra.send(post(completion("x", 2)))
    refused = await extra.answer()
    assert refused.status == 503
    assert "too many connections" in json.loads(refused.body)["error"]["message"]
    assert r.server.evicted_connections == 0

    d.hold.set()
    uploading.send(body)
    for i, c in enumerate(waiting):
        answer = await c.answer()
        assert answer.status == 200
        assert json.loads(answer.body)["choices"][0]["text"] == expected_text(f"w{i}", 2)
    assert (await uploading.answer()).status == 200


async def test_the_longest_idle_connection_goes_first(
    engines: EngineFactory, start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = await lockout_router(engines, start_router, cap=3)
    monkeypatch.setattr(r.server, "evict_grace_s", 0.0)  # the order is under test, not the grace
    oldest, newer = await RawClient.to(r), await RawClient.to(r)
    for c in (oldest, newer):
        c.send(post(completion("o", 2)))
        assert (await c.answer()).status == 200
    busy = await RawClient.to(r)
    busy_body = completion("b", 2)
    busy.send(post(busy_body)[: -len(busy_body)])  # a head whose body has not come: in progress
    await wait_until(lambda: len(r.server.connections) == 3 and len(r.server.idle) == 2, "two idle")

    assert await generate(r, "n") == 200  # takes the slot of `oldest`
    assert await oldest.closed_by_server()
    newer.send(post(completion("still", 2)))
    assert (await newer.answer()).status == 200
    busy.send(busy_body)
    assert (await busy.answer()).status == 200
