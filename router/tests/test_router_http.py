"""The router's HTTP/1.1 server as a client sees it, byte by byte on raw sockets.

Malformed requests, body limits, chunked request bodies, 100-continue, keep-alive, pipelining order,
chunked SSE answers, back-pressure on a client that does not read, and disconnects mid-stream.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from raw_client import Answer, RawClient, completion, post
from router_engine_double import expected_text
from router_harness import EngineFactory, RouterFactory, RunningRouter, wait_event, wait_until

from dllm_router.httpserver import HttpServer, Request, Response, StreamWriter, limits
from dllm_router.openai import COMPLETIONS

pytestmark = pytest.mark.timeout(20)


def text_of(answer: Answer) -> str:
    assert answer.status == 200, answer
    return str(json.loads(answer.body)["choices"][0]["text"])


async def router_with_engines(
    engines: EngineFactory, start_router: RouterFactory, **kw: object
) -> RunningRouter:
    return await start_router("dllm", [await engines("p0")], [await engines("d0")], **kw)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n",
    ],
)
async def test_malformed_request_is_400_and_the_connection_closes(
    engines: EngineFactory, start_router: RouterFactory, garbage: bytes
) -> None:
    r = await router_with_engines(engines, start_router)
    c = await RawClient.to(r)
    c.send(garbage)
    answer = await c.answer()
    assert answer.status == 400
    assert answer.headers["connection"] == "close"
    assert json.loads(answer.body)["error"]["type"] == "bad_request"
    assert await c.closed_by_server()
    assert r.router.metrics.errors["bad_request"] == 1


async def test_declared_body_over_the_limit_is_413_before_it_is_sent(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router, max_body_mb=1)
    c = await RawClient.to(r)
    c.send(
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n"
        % (1024 * 1024 + 1)
    )  # the head only: a client that waits for 100 Continue sends nothing more
    answer = await c.answer()
    assert answer.status == 413
    assert json.loads(answer.body)["error"]["message"] == "request body over 1 MiB (--max-body-mb)"
    assert await c.closed_by_server()
    assert r.router.metrics.requests[(COMPLETIONS, 413)] == 1


async def test_chunked_body_over_the_limit_is_413(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router, max_body_mb=1)
    c = await RawClient.to(r)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b" " * 65536
    for _ in range(17):  # 17 x 64 KiB: over 1 MiB
        c.send(b"%x\r\n%b\r\n" % (len(piece), piece))
    answer = await c.answer()
    assert answer.status == 413
    assert await c.closed_by_server()


async def test_chunked_request_body_is_read_whole(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router)
    body = completion("chunked prompt", 3)
    c = await RawClient.to(r)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n")
    for part in (body[:7], body[7:20], body[20:]):
        c.send(b"%x\r\n%b\r\n" % (len(part), part))
    c.send(b"0\r\n\r\n")
    assert text_of(await c.answer()) == expected_text("chunked prompt", 3)


async def test_expect_100_continue_gets_continue_then_the_answer(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router)
    body = completion("continue", 2)
    c = await RawClient.to(r)
    c.send(post(body, extra=b"Expect: 100-continue\r\n")[: -len(body)])
    status, _ = await c.head()
    assert status == 100
    c.send(body)
    assert text_of(await c.answer()) == expected_text("continue", 2)


async def test_keep_alive_serves_several_requests_on_one_connection(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router)
    c = await RawClient.to(r)
    for i in range(3):
        c.send(post(completion(f"k{i}")))
        answer = await c.answer()
        assert text_of(answer) == expected_text(f"k{i}", 2)
        assert "connection" not in answer.headers  # HTTP/1.1: kept open
    c.send(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
    last = await c.answer()
    assert (last.status, last.headers["connection"]) == (200, "close")
    assert await c.closed_by_server()


async def test_pipelined_requests_are_answered_in_order(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.hold = asyncio.Event()
    r = await start_router("dllm", [p], [d])
    c = await RawClient.to(r)
    c.send(post(completion("first")) + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n" + post(completion("third")))
    await wait_event(d.arrived, "the first request's decode call")  # all three are read by now
    d.hold.set()
    first, second, third = await c.answer(), await c.answer(), await c.answer()
    assert text_of(first) == expected_text("first", 2)
    assert json.loads(second.body)["status"] == "ok"
    assert text_of(third) == expected_text("third", 2)


async def test_stream_is_chunked_sse_and_the_connection_is_reused(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router)
    c = await RawClient.to(r)
    c.send(post(completion("s", 3, stream=True)))
    answer = await c.answer()
    assert answer.headers["content-type"] == "text/event-stream"
    events = [e.removeprefix(b"data: ") for e in answer.body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected_text("s", 3)
    c.send(post(completion("after")))
    assert text_of(await c.answer()) == expected_text("after", 2)


async def test_http10_client_gets_its_answer_and_the_connection_closes(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router)
    c = await RawClient.to(r)
    c.send(b"GET /health HTTP/1.0\r\n\r\n")
    answer = await c.answer()
    assert answer.status == 200
    assert await c.closed_by_server()


async def test_unknown_path_is_404_and_wrong_method_405(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    r = await router_with_engines(engines, start_router)
    c = await RawClient.to(r)
    c.send(b"GET /nope HTTP/1.1\r\nHost: r\r\n\r\n")
    assert (await c.answer()).status == 404
    c.send(b"GET /v1/completions HTTP/1.1\r\nHost: r\r\n\r\n")
    wrong = await c.answer()
    assert (wrong.status, wrong.headers["allow"]) == (405, "POST")
    c.send(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
    status, headers = await c.head()  # HEAD: the head only, no body follows
    assert (status, int(headers["content-length"]) > 0) == (200, True)
    c.send(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
    assert (await c.answer()).status == 200


async def test_client_closing_mid_stream_cancels_decode(
    engines: EngineFactory, start_router: RouterFactory
) -> None:
    p, d = await engines("p0"), await engines("d0")
    d.hold_after_first_chunk = asyncio.Event()
    r = await start_router("dllm", [p], [d])
    c = await RawClient.to(r)
    c.send(post(completion("long", 50, stream=True)))
    status, _ = await c.head()
    assert status == 200
    assert (await c.chunk()).startswith(b"data: ")
    c.close()
    await wait_event(d.cancelled_event, "decode cancelled")
    await wait_until(lambda: r.router.metrics.errors["client_disconnect"] == 1, "disconnect counted")
    await wait_until(lambda: r.router.decode.endpoints[("127.0.0.1", d.port)].inflight == 0, "inflight 0")


async def test_stream_to_a_client_that_does_not_read_waits_then_delivers_everything() -> None:
    total, piece = 32, b"x" * (1024 * 1024)
    written: list[int] = []

    async def flood(request: Request) -> StreamWriter:
        out = request.stream({"Content-Type": "application/octet-stream"})
        for i in range(total):
            await out.write(piece)
            written.append(i)
        await out.finish()
        return out

    async def small(_: Request) -> Response:
        return Response(b"{}")

    server = HttpServer({("GET", "/flood"): flood, ("GET", "/small"): small}, max_body=1024)
    await server.start("127.0.0.1", 0)
    try:
        c = await RawClient.to(server.addresses[0][1])
        c.send(b"GET /flood HTTP/1.1\r\nHost: s\r\n\r\n")
        [conn] = server.connections
        await wait_until(lambda: conn.write_paused, "the server's writes paused")
        assert len(written) < total  # the handler waits instead of buffering 32 MiB
        answer = await c.answer()
        assert answer.body == piece * total
        c.send(b"GET /small HTTP/1.1\r\nHost: s\r\n\r\n")
        assert (await c.answer()).body == b"{}"
    finally:
        await server.cleanup(0.5)


async def test_idle_and_stalled_connections_are_closed_after_the_keep_alive_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits, "KEEPALIVE_S", 0.2)

    async def small(_: Request) -> Response:
        return Response(b"{}")

    server = HttpServer({("GET", "/small"): small}, max_body=1024)
    await server.start("127.0.0.1", 0)
    try:
        port = server.addresses[0][1]
        idle, stalled = await RawClient.to(port), await RawClient.to(port)
        idle.send(b"GET /small HTTP/1.1\r\nHost: s\r\n\r\n")
        assert (await idle.answer()).body == b"{}"
        stalled.send(b"GET /small HTTP/1.1\r\nHost:")  # a head that never ends
        assert await idle.closed_by_server()
        assert await stalled.closed_by_server()
    finally:
        await server.cleanup(0.5)
