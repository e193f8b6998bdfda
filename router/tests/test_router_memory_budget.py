"""NEW-1: the router's memory budget, over real HTTP against engine doubles whose answers are large.

An engine answer is charged to its request as it arrives: past --max-answer-mb the request gets 502
`answer_too_large`, past the router's --memory-budget-mb 503 `memory_budget`, at once and without the
rest of the answer being read; everyone else keeps being served, and every byte is given back when a
request ends (the /metrics gauge is back at zero)."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import re
from typing import Any

import pytest
from router_engine_double import expected_text
from router_harness import EngineFactory, RouterFactory, RunningRouter, wait_until

from dllm_router.openai import COMPLETIONS

pytestmark = pytest.mark.timeout(30)
MIB = 2**20


def error_of(text: str) -> dict[str, object]:
    error = json.loads(text)["error"]
    assert isinstance(error, dict)
    return error


async def held_bytes(r: RunningRouter) -> int:
    async with r.client.get(r.url + "/metrics") as page:
        text = await page.text()
    found = re.search(r'^dllm_router_memory_budget_bytes\{state="held"\} (\d+)', text, re.MULTILINE)
    assert found is not None
    return int(found.group(1))


@pytest.mark.parametrize("flow", ["dllm", "nixl", "mooncake"])
@pytest.mark.parametrize("prompts", [1, 4])  # one prompt, non-streamed: the fast path (dllm, nixl)
async def test_answers_over_the_cap_are_502_while_a_normal_request_gets_200(
    engines: EngineFactory, start_router: RouterFactory, bootstrap: Any, flow: str, prompts: int
) -> None:
    p, d = await engines("p0"), await engines("d0")
    boot = await bootstrap(["e0"])
    r = await start_router(
        flow, [p], [d], max_answer_mb=2, memory_budget_mb=64, mooncake_bootstrap_port=boot.port
    )
    d.padding = "x" * (3 * MIB // prompts)  # each big request's answers: 3 MiB in all, over the 2 MiB cap
    big = {"prompt": [f"big{i}" for i in range(prompts)] if prompts > 1 else "big", "max_tokens": 2}
    attack = [r.text_of(COMPLETIONS, big) for _ in range(8)]
    *results, (status, text) = await asyncio.gather(
        *attack, r.text_of(COMPLETIONS, {"prompt": "normal", "max_tokens": 2})
    )
    assert status == 200, text  # 8 x 2 MiB at most are held before the cuts: within the 64 MiB budget
    assert json.loads(text)["choices"][0]["text"] == expected_text("normal", 2)
    for status, text in results:
        assert status == 502, text
        error = error_of(text)
        assert error["type"] == "answer_too_large"
        assert "over 2 MiB (--max-answer-mb)" in str(error["message"])
    assert r.router.metrics.errors["answer_too_large"] == 8
    assert r.router.budget.held == 0
    assert await held_bytes(r) == 0


async def test_the_budget_spent_is_503_and_given_back(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d], max_answer_mb=8, memory_budget_mb=4)
    d.padding = "x" * (3 * MIB)  # within the request's cap, but two at once are over the router's budget
    results = await asyncio.gather(
        *(r.text_of(COMPLETIONS, {"prompt": f"big{i}", "max_tokens": 2}) for i in range(6))
    )
    statuses = [status for status, _ in results]
    assert 503 in statuses
    assert set(statuses) <= {200, 503}
    for status, text in results:
        if status == 503:
            error = error_of(text)
            assert error["type"] == "memory_budget"
            assert "memory budget (4 MiB, --memory-budget-mb)" in str(error["message"])
    assert r.router.budget.held == 0
    assert await held_bytes(r) == 0
    d.padding = ""
    assert (await r.text_of(COMPLETIONS, {"prompt": "after", "max_tokens": 2}))[0] == 200


def cyclic_garbage_bytes(least: int) -> list[int]:
    """Sizes of the bytes and bytearrays of `least` or more that only reference cycles keep alive: what
    the garbage collector would free, whenever it next runs."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = {
            id(o): len(o)
            for holder in gc.garbage
            for o in gc.get_referents(holder)
            if isinstance(o, bytes | bytearray) and len(o) >= least
        }
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return list(found.values())


@pytest.mark.parametrize("flow", ["dllm", "nixl"])
async def test_answers_of_a_failed_request_are_dropped_when_it_ends(
    engines: EngineFactory, start_router: RouterFactory, flow: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes given back to the budget when a request fails are freed then, not left to the garbage
    collector in a failed prompt's traceback's reference cycles (frames, tasks, the sibling prompts'
    answers): those held ~6x the budget at the measured peak (test_router_memory_rss)."""
    # pytest keeps every log record, and a record's arguments (an upstream error) would keep them alive
    monkeypatch.setattr(logging.getLogger("dllm_router"), "propagate", False)
    p, d = await engines("p0"), await engines("d0")
    r = await start_router(flow, [p], [d], max_answer_mb=2, memory_budget_mb=64)
    d.padding = "x" * (MIB // 2)  # four prompts' answers: 2 MiB, over the cap at the fourth
    big = {"prompt": [f"big{i}" for i in range(5)], "max_tokens": 2}
    gc.collect()
    gc.disable()
    try:
        results = await asyncio.gather(*(r.text_of(COMPLETIONS, big) for _ in range(4)))
        assert {status for status, _ in results} == {502}
        assert cyclic_garbage_bytes(MIB // 4) == []
    finally:
        gc.enable()


def held_at_least(r: RunningRouter, least: int) -> bool:
    return r.router.budget.held >= least


def oldest_upload_past_the_grace(r: RunningRouter) -> bool:
    server = r.server
    return (
        bool(server.uploads)
        and server.loop.time() - next(iter(server.uploads.values())) > server.evict_grace_s
    )


async def test_stalled_uploads_are_charged_and_the_oldest_gives_way_so_others_are_served(
    engines: EngineFactory, start_router: RouterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """NEW-1: a body is held piece by piece while it is read, long before its handler charges it, so it
    is charged as it arrives. Uploads that each send 1.4 MiB of a declared 1.5 MiB and stall (within the
    body timeout) fill the 4 MiB budget; when another upload needs room, the oldest stalled one is
    refused 503 `memory_budget` and gives its bytes back, and a normal request is served meanwhile. What
    the stalled uploads held is given back when they leave."""
    caplog.set_level(logging.INFO)
    p, d = await engines("p0"), await engines("d0")
    r = await start_router("dllm", [p], [d], memory_budget_mb=4, max_body_mb=2)
    port = int(r.url.rsplit(":", 1)[1])
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        f"Content-Length: {3 * MIB // 2}\r\n\r\n"
    ).encode()
    part = 14 * MIB // 10
    stalled: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for i in range(3):
            if i == 2:  # the first is old enough to give way (the grace spares just-begun uploads)
                await wait_until(functools.partial(oldest_upload_past_the_grace, r), "the grace to pass")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + b'{"prompt": "' + b"x" * part)
            await writer.drain()
            stalled.append((reader, writer))
            if i < 2:
                await wait_until(functools.partial(held_at_least, r, (i + 1) * part), "charged")
        refused = await asyncio.wait_for(stalled[0][0].read(), 10)  # the oldest: answered, then closed
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        assert b'"type":"memory_budget"' in refused.replace(b" ", b""), refused[-300:]
        assert b"the oldest in progress, was given up to make room" in refused
        await wait_until(functools.partial(held_at_least, r, 2 * part), "the newest upload charged")
        status, text = await r.text_of(COMPLETIONS, {"prompt": "meanwhile", "max_tokens": 2})
        assert status == 200, text
        assert r.server.evicted_uploads >= 1
    finally:
        for _, writer in stalled:
            writer.close()
    await wait_until(lambda: r.router.budget.held == 0, "the stalled uploads' bytes given back")
    assert await held_bytes(r) == 0
