"""Abuse of the real `dllm-router` process over raw sockets, with its memory (RSS) and the time of each
refusal bounded: slowloris heads, an unterminated header, pipelining without reading, bodies over the
limit or too costly to parse, connection number N+1, and silent connections at the cap (NEW-5).

The router runs as the operator runs it (`python -m dllm_router`, flags); its engines are a
port that refuses connections, since nothing here must reach an engine. RSS is read from /proc.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from raw_client import RawClient
from router_process import RouterProcess, router_process

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RSS"),
]
MAX_CONNECTIONS = 24
HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with socket.socket() as nobody:  # bound, never listening: engine calls are refused at once
        nobody.bind(("127.0.0.1", 0))
        engine = f"http://127.0.0.1:{nobody.getsockname()[1]}"
        flags = [
            "--flow", "dllm", "--prefill-url", engine, "--decode-url", engine, "--log-level", "info",
            "--max-connections", str(MAX_CONNECTIONS), "--head-timeout-s", str(HEAD_TIMEOUT_S),
            "--body-timeout-s", str(BODY_TIMEOUT_S), "--health-interval-s", "60",
        ]  # fmt: skip
        with router_process(flags, tmp_path_factory.mktemp("router") / "router.log") as process:
            yield process


async def trickle(c: RawClient, data: bytes, every_s: float) -> None:
    """A slowloris client: one byte per `every_s` (the behaviour under test)."""
    for i in range(len(data)):
        c.send(data[i : i + 1])
        await asyncio.sleep(every_s)


async def test_slowloris_heads_are_408_at_the_deadline_and_cost_nothing(router: RouterProcess) -> None:
    await router.quiet()
    before = router.rss()
    clients = [await router.client() for _ in range(MAX_CONNECTIONS // 2)]
    started = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: " + b"s" * 10_000
    slow = [asyncio.ensure_future(trickle(c, head, 0.05)) for c in clients]
    try:
        answers = await asyncio.gather(*(c.answer() for c in clients))
    finally:
        for task in slow:
            task.cancel()
    took = time.monotonic() - started
    assert {a.status for a in answers} == {408}
    assert HEAD_TIMEOUT_S * 0.9 <= took <= HEAD_TIMEOUT_S + 4.0  # each byte did not reset the deadline
    assert all([await c.closed_by_server() for c in clients])
    assert router.rss() - before < 8 * MIB


async def test_unterminated_header_is_431_in_bounded_time_and_memory(router: RouterProcess) -> None:
    async def send(size: int) -> float:
        c = await router.client()
        started = time.monotonic()
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX: ")
        piece = b"a" * 65536
        for _ in range(size // len(piece)):  # the writer buffers what the router does not take
            c.send(piece)
        answer = await c.answer()
        assert answer.status == 431
        assert answer.headers["connection"] == "close"
        took = time.monotonic() - started
        c.close()
        return took

    before = router.rss()
    one, four = await send(MIB), await send(4 * MIB)
    assert four <= 4 * one + 1.0  # linear at worst (the answer comes at the limit: about constant)
    assert router.rss() - before < 4 * MIB  # the review's 2 MiB, with room for the allocator


async def test_pipelining_without_reading_does_not_buffer_answers(router: RouterProcess) -> None:
    probe = await router.client()
    probe.send(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
    page = len((await probe.answer()).body)
    probe.close()
    count = 10_000  # x page (~ KiBs): tens of MB if the router made every answer at once
    before = router.rss()
    c = await router.client(rcvbuf=16384)
    c.send(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n" * count)
    await router.idle()  # it has made every answer it was going to make before holding back
    held = router.rss() - before
    assert held < 8 * MIB, f"{held / MIB:.1f} MiB with {count} answers of {page} bytes asked"
    for _ in range(count):
        answer = await c.answer()
        assert answer.status == 200
    c.close()
    assert page * count > 3 * 8 * MIB  # what unbounded buffering would have cost


async def test_bodies_over_the_limit_are_refused_before_they_are_read(router: RouterProcess) -> None:
    before = router.rss()
    declared = await router.client()
    declared.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % (9 * MIB))
    answer = await declared.answer()
    assert answer.status == 413
    assert b"request body over 8 MiB (--max-body-mb)" in answer.body
    assert await declared.closed_by_server()
    chunked = await router.client()
    chunked.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 65536
    for _ in range(9 * 16):  # 9 MiB in 64 KiB chunks
        chunked.send(b"%x\r\n%b\r\n" % (len(piece), piece))
    assert (await chunked.answer()).status == 413
    chunked.close()
    assert router.rss() - before < 24 * MIB  # at most one body's worth (8 MiB) and its join


async def test_a_body_too_costly_to_parse_is_400_fast(router: RouterProcess) -> None:
    before = router.rss()
    raw = b'{"prompt":[' + b"[1]," * (5 * MIB // 4) + b"[1]]}"
    c = await router.client()
    started = time.monotonic()
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(raw), raw))
    answer = await c.answer()
    assert answer.status == 400
    assert b"more than 20000 arrays and objects" in answer.body
    assert time.monotonic() - started < 3.0  # the upload of 5 MiB included
    assert router.rss() - before < 50 * MIB  # the review's bound (json.loads would take ~120 MB)


async def test_nine_concurrent_full_size_bodies_stay_within_a_computed_bound(router: RouterProcess) -> None:
    """H2: with --max-body-mb 8, nine bodies at the limit at once. Each costs its pieces, their join and
    the parsed prompt string (3 x 8 MiB) at most; nothing is kept once answered (no engine is ready)."""
    await router.quiet()
    before = router.rss()
    prompt = "x" * (8 * MIB - 100)
    raw = b'{"prompt":"%b","max_tokens":4}' % prompt.encode()
    clients = [await router.client() for _ in range(9)]
    try:
        for c in clients:
            c.send(
                b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(raw), raw)
            )
        answers = await asyncio.gather(*(c.answer() for c in clients))
    finally:
        for c in clients:
            c.close()
    statuses = {a.status for a in answers}
    assert 503 in statuses  # read whole and parsed, then: no ready prefill pod
    assert statuses <= {503, 408}  # 408: an upload past the 3 s body deadline on a loaded machine
    assert router.peak_rss() - before < 9 * 3 * 8 * MIB + 32 * MIB


async def test_a_slow_body_is_408_at_its_deadline(router: RouterProcess) -> None:
    c = await router.client()
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100000\r\n\r\n")
    started = time.monotonic()
    slow = asyncio.ensure_future(trickle(c, b"b" * 10_000, 0.05))
    try:
        answer = await c.answer()
    finally:
        slow.cancel()
    assert answer.status == 408
    assert BODY_TIMEOUT_S * 0.9 <= time.monotonic() - started <= BODY_TIMEOUT_S + 4.0


async def test_connection_over_the_cap_gets_503_when_every_one_has_a_request_in_progress(
    router: RouterProcess,
) -> None:
    """M1 with NEW-5's eviction: only connections whose request is in progress (here a body still
    coming) hold their slot, so connection N+1 is refused; once they close, service goes on."""
    await router.quiet()
    held = [await router.client() for _ in range(MAX_CONNECTIONS)]
    for c in held:  # a head whose body never comes: a request in progress until the body deadline
        c.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n"
        )
    for c in held:
        assert await c.head() == (100, {})  # its head is read: the request is in progress
    extra = await router.client()
    extra.send(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
    refused = await extra.answer()
    assert refused.status == 503
    assert b"too many connections" in refused.body
    assert await extra.closed_by_server()
    for c in held:
        c.close()

    async def served() -> bool:
        c = await router.client()
        c.send(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        status = (await c.answer()).status
        c.close()
        return status == 200

    async with asyncio.timeout(10):
        while not await served():  # the held connections' slots free as the router sees them close
            pass


async def test_silent_connections_at_the_cap_lock_nobody_out(router: RouterProcess) -> None:
    """NEW-5: an attacker holds --max-connections silent sockets and re-opens each one the router
    closes. A real client is still served, well before any silent socket's deadline (it takes the slot
    of the longest-silent one; a 503 only while every silent one is younger than the eviction grace,
    then retried), and each silent socket is closed by the first-byte deadline (the head deadline
    here) at the latest."""
    await router.quiet()
    closed_after: list[float] = []
    opened = 0
    all_open = asyncio.Event()  # every attacker connected once

    async def hold_a_slot() -> None:
        nonlocal opened
        while True:
            c = await router.client()
            opened += 1
            if opened == MAX_CONNECTIONS:
                all_open.set()
            at = time.monotonic()
            try:
                async with asyncio.timeout(HEAD_TIMEOUT_S + 5.0):
                    assert await c.reader.read() == b""  # the router closed it, having said nothing
            finally:
                c.close()
            closed_after.append(time.monotonic() - at)

    attackers = [asyncio.ensure_future(hold_a_slot()) for _ in range(MAX_CONNECTIONS)]
    try:
        await asyncio.wait_for(all_open.wait(), 10)
        for _ in range(5):
            started = time.monotonic()
            status = 503
            while status == 503:
                c = await router.client()
                c.send(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
                status = (await c.answer()).status
                c.close()
            assert status == 200
            assert time.monotonic() - started < HEAD_TIMEOUT_S  # no silent socket had to time out
    finally:
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)
    assert closed_after, "the router closed no silent connection"
    assert max(closed_after) <= HEAD_TIMEOUT_S + 1.0  # the deadline, plus the sweep's quarter of it
    metrics = await router.client()
    metrics.send(b"GET /metrics HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
    page = (await metrics.answer()).body
    evicted = re.search(rb"^dllm_router_evicted_connections_total (\d+)", page, re.MULTILINE)
    assert evicted is not None
    # Only the first real request is sure to meet a full cap: its connection is queued behind every
    # attacker's, well within their first-byte deadline. A later one may find a slot freed by a silent
    # socket's deadline, or by the request before it, ahead of the evicted attacker's reconnection.
    assert int(evicted.group(1)) >= 1
