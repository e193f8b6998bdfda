"""The HTTP server's limits against hostile clients, in-process on raw sockets: the head's size counted
before the parser sees it (H1), write back-pressure across pipelined requests and the write timeout
(H3), head and body deadlines and the connection cap (M1)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from raw_client import RawClient
from router_harness import WAIT_S, wait_event, wait_until

from dllm_router import httpserver
from dllm_router.httpserver import MAX_HEAD, HttpServer, Request, Response, StreamWriter, limits

pytestmark = pytest.mark.timeout(30)
ANSWER = b"y" * 8192  # one answer of /big


async def big(_: Request) -> Response:
    return Response(ANSWER, content_type="application/octet-stream")


async def small(_: Request) -> Response:
    return Response(b"{}")


ServerFactory = Callable[..., Awaitable[HttpServer]]


@pytest.fixture
async def server() -> AsyncIterator[ServerFactory]:
    made: list[HttpServer] = []

    async def make(**kw: object) -> HttpServer:
        routes = {("GET", "/big"): big, ("GET", "/small"): small, **kw.pop("routes", {})}  # type: ignore[dict-item]
        s = HttpServer(routes, max_body=1024 * 1024, **kw)  # type: ignore[arg-type]
        await s.start("127.0.0.1", 0)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.cleanup(0.2)


def port_of(s: HttpServer) -> int:
    return s.addresses[0][1]


async def trickle(c: RawClient, data: bytes, every_s: float) -> None:
    """A slow client: one byte per `every_s` (the behaviour under test, not a wait for a condition)."""
    for i in range(len(data)):
        c.send(data[i : i + 1])
        await asyncio.sleep(every_s)


# ---- H1 ----


async def test_unterminated_header_is_431_before_the_parser_holds_more_than_the_limit(
    server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed: list[int] = []
    feed = httpserver.Connection._feed

    def counting(conn: httpserver.Connection, data: memoryview) -> None:
        fed.append(len(data))
        feed(conn, data)

    monkeypatch.setattr(httpserver.Connection, "_feed", counting)
    s = await server()
    c = await RawClient.to(port_of(s))
    c.send(b"POST /v1/completions HTTP/1.1\r\nX: ")
    piece = b"a" * 65536
    for _ in range(16):  # 1 MiB in 64 KiB writes, never a line end
        c.send(piece)
    answer = await c.answer()
    assert answer.status == 431
    assert answer.headers["connection"] == "close"
    assert await c.closed_by_server()
    assert sum(fed) <= MAX_HEAD + 1  # counted before feeding: the parser never held more


async def test_a_head_at_the_limit_is_served_and_pipelined_heads_count_separately(
    server: ServerFactory,
) -> None:
    s = await server()
    c = await RawClient.to(port_of(s))
    filler = b"X-Fill: " + b"f" * (MAX_HEAD - 200) + b"\r\n"
    one = b"GET /small HTTP/1.1\r\nHost: s\r\n" + filler + b"\r\n"
    c.send(one * 3)  # three near-limit heads in one write: each is counted on its own
    for _ in range(3):
        assert (await c.answer()).body == b"{}"


# ---- H3 ----


async def test_pipelining_without_reading_holds_back_instead_of_buffering(
    server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffered: list[int] = []  # the server's write buffer after each write
    write = httpserver.Connection.write

    def recording(conn: httpserver.Connection, data: bytes) -> None:
        write(conn, data)
        if conn.transport is not None:
            buffered.append(conn.transport.get_write_buffer_size())

    monkeypatch.setattr(httpserver.Connection, "write", recording)
    s = await server()
    c = await RawClient.to(port_of(s), rcvbuf=4096)
    [conn] = await connections(s, 1)
    transport = conn.transport
    assert transport is not None
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    count = 2000
    c.send(b"GET /big HTTP/1.1\r\nHost: s\r\n\r\n" * count)  # 16 MB of answers if all were made at once
    await wait_until(lambda: conn.write_paused and conn._read_paused, "the server holding back")
    for _ in range(count):  # nothing was lost: every answer comes, in order, once the client reads
        answer = await c.answer()
        assert answer.body == ANSWER
    high = transport.get_write_buffer_limits()[1]
    assert max(buffered) <= high + len(ANSWER) + 512  # at most one answer past the high-water mark
    c.send(b"GET /small HTTP/1.1\r\nHost: s\r\n\r\n")
    assert (await c.answer()).body == b"{}"


async def test_a_client_that_stops_reading_mid_answer_is_aborted_after_the_write_timeout(
    server: ServerFactory,
) -> None:
    cancelled = asyncio.Event()

    async def flood(request: Request) -> StreamWriter:
        out = request.stream({"Content-Type": "application/octet-stream"})
        try:
            while True:
                await out.write(b"z" * 65536)
        except (ConnectionResetError, asyncio.CancelledError):
            cancelled.set()
            raise

    s = await server(routes={("GET", "/flood"): flood}, write_timeout_s=0.5)
    c = await RawClient.to(port_of(s), rcvbuf=4096)
    c.send(b"GET /flood HTTP/1.1\r\nHost: s\r\n\r\n")
    [conn] = await connections(s, 1)
    await wait_until(lambda: conn.write_paused, "the server's writes paused")
    started = time.monotonic()
    await wait_until(lambda: not s.connections, "the connection aborted", limit_s=WAIT_S)
    assert 0.4 <= time.monotonic() - started <= 3.0
    await wait_event(cancelled, "the handler cancelled")


# ---- M1 ----


async def test_slowloris_head_is_408_after_the_head_deadline(
    server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "KEEPALIVE_S", 60.0)  # only the head deadline applies
    s = await server(head_timeout_s=0.6)
    c = await RawClient.to(port_of(s))
    started = time.monotonic()
    slow = asyncio.ensure_future(trickle(c, b"GET /small HTTP/1.1\r\nX-Slow: " + b"s" * 1000, 0.05))
    try:
        answer = await c.answer()
    finally:
        slow.cancel()
    took = time.monotonic() - started
    assert answer.status == 408
    assert "request head not complete within 0.6 s" in answer.body.decode()
    assert 0.5 <= took <= 3.0  # each byte did not reset the deadline


async def test_slow_body_is_408_after_the_body_deadline(
    server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "KEEPALIVE_S", 60.0)

    async def echo(request: Request) -> Response:
        return Response(request.body)

    s = await server(routes={("POST", "/echo"): echo}, body_timeout_s=0.6)
    c = await RawClient.to(port_of(s))
    c.send(b"POST /echo HTTP/1.1\r\nHost: s\r\nContent-Length: 1048576\r\n\r\n")
    started = time.monotonic()
    slow = asyncio.ensure_future(trickle(c, b"b" * 1000, 0.05))
    try:
        answer = await c.answer()
    finally:
        slow.cancel()
    assert answer.status == 408
    assert "request body not complete within 0.6 s" in answer.body.decode()
    assert 0.5 <= time.monotonic() - started <= 3.0
    assert await c.closed_by_server()


async def test_connection_over_the_cap_gets_503_and_a_freed_slot_serves_again(server: ServerFactory) -> None:
    """Every slot has a request in progress, so there is no idle connection to evict (NEW-5): 503."""
    release = asyncio.Event()

    async def held(_: Request) -> Response:
        await release.wait()
        return Response(b"{}")

    s = await server(max_connections=3, routes={("GET", "/held"): held})
    port = port_of(s)
    busy = [await RawClient.to(port) for _ in range(3)]
    for c in busy:
        c.send(b"GET /held HTTP/1.1\r\nHost: s\r\n\r\n")
    await wait_until(lambda: len(s.connections) == 3 and not s.idle, "three requests in progress")
    extra = await RawClient.to(port)
    extra.send(b"GET /small HTTP/1.1\r\nHost: s\r\n\r\n")
    refused = await extra.answer()
    assert refused.status == 503
    assert "too many connections" in refused.body.decode()
    assert await extra.closed_by_server()
    assert (s.refused_connections, s.evicted_connections) == (1, 0)
    release.set()
    for c in busy:
        assert (await c.answer()).body == b"{}"
    busy[0].close()
    await wait_until(lambda: len(s.connections) == 2, "a slot freed")
    again = await RawClient.to(port)
    again.send(b"GET /small HTTP/1.1\r\nHost: s\r\n\r\n")
    assert (await again.answer()).body == b"{}"


async def connections(s: HttpServer, n: int) -> list[httpserver.Connection]:
    await wait_until(lambda: len(s.connections) == n, f"{n} connections at the server")
    return list(s.connections)
