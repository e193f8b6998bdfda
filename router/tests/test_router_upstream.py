"""The router's upstream HTTP/1.1 client against raw servers on 127.0.0.1 that send exact bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dllm_router.upstream import (
    BadResponse,
    Call,
    ConnectFailed,
    Deadlines,
    Disconnected,
    UpstreamPool,
)

pytestmark = pytest.mark.timeout(10)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


class RawServer:
    """A TEST DOUBLE HTTP server: each connection runs `handler`, which writes whatever bytes it likes."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])


RawFactory = Callable[[Handler], Awaitable[tuple[RawServer, UpstreamPool]]]


@pytest.fixture
async def raw() -> AsyncIterator[RawFactory]:
    servers: list[RawServer] = []

    async def make(handler: Handler) -> tuple[RawServer, UpstreamPool]:
        server = RawServer(handler)
        servers.append(server)
        return server, UpstreamPool("127.0.0.1", await server.start(), connect_timeout_s=2.0)

    yield make
    for server in servers:
        server.server.close()


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_content_length_bytes_one_by_one_and_connection_reuse(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            server.requests.append(await read_request(reader))
            for byte in answer(b'{"ok": true}'):
                writer.write(bytes([byte]))
                await writer.drain()

    server, pool = await raw(handler)
    for _ in range(3):
        response = await pool.post("/v1/completions", b"X-Request-Id: r1\r\n", b"{}", 5.0)
        assert response.status == 200
        assert await response.read() == b'{"ok": true}'
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"X-Request-Id: r1\r\n" in server.requests[0]
    assert server.requests[0].endswith(b"Content-Length: 2\r\nX-Request-Id: r1\r\n\r\n{}")


async def test_chunked_body_with_extensions_and_trailers(raw: RawFactory) -> None:
    wire = b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(wire), 3):
                writer.write(wire[i : i + 3])
                await writer.drain()

    server, pool = await raw(handler)
    response = await pool.post("/x", b"", b"", 5.0)
    assert b"".join([c async for c in response.chunks()]) == b"hello world"
    response = await pool.post("/x", b"", b"", 5.0)
    assert await response.read() == b"hello world"
    assert server.connections == 1


async def test_body_until_close_is_read_and_not_reused(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")

    server, pool = await raw(handler)
    assert await (await pool.post("/x", b"", b"", 5.0)).read() == b"all of it"
    assert await (await pool.post("/x", b"", b"", 5.0)).read() == b"all of it"
    assert server.connections == 2


async def test_interim_100_continue_is_skipped(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"x"))

    _, pool = await raw(handler)
    response = await pool.post("/x", b"", b"", 5.0)
    assert (response.status, await response.read()) == (200, b"x")


async def test_stale_keep_alive_connection_is_resent_on_a_new_one(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer(b"first" if index == 1 else b"fresh"))
        await writer.drain()
        if index == 1:
            await read_request(reader)  # the pod takes the second request, then closes without answering

    server, pool = await raw(handler)
    assert await (await pool.post("/x", b"", b"", 5.0)).read() == b"first"
    assert await (await pool.post("/x", b"", b"", 5.0)).read() == b"fresh"
    assert server.connections == 2


async def test_connect_refused_is_connect_failed() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectFailed, match=r"cannot connect to 127\.0\.0\.1"):
        await UpstreamPool("127.0.0.1", port, 2.0).post("/x", b"", b"", 5.0)


async def test_silent_pod_times_out_and_the_connection_is_dropped(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        if not await reader.read():  # never answers; b"" once the client gives up
            server.closed_by_client.set()

    server, pool = await raw(handler)
    with pytest.raises(TimeoutError):
        await pool.post("/x", b"", b"", 0.2)
    await asyncio.wait_for(server.closed_by_client.wait(), 5)


async def answers_part_of_the_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
) -> None:
    """A pod that declares 100 bytes of body, sends 7 and closes."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")


async def test_close_mid_body_is_disconnected(raw: RawFactory) -> None:
    _, pool = await raw(answers_part_of_the_body)
    response = await pool.post("/x", b"", b"", 5.0)
    with pytest.raises(Disconnected) as broken:
        await response.read()
    assert not broken.value.before_head


async def test_not_http_is_bad_response(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await reader.read()

    _, pool = await raw(handler)
    with pytest.raises(BadResponse, match=r"not an HTTP/1\.x answer"):
        await pool.post("/x", b"", b"", 5.0)


async def test_closing_an_unfinished_answer_drops_the_connection(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        if not await reader.read():  # b"": the client closed the connection
            server.closed_by_client.set()

    server, pool = await raw(handler)
    response = await pool.post("/x", b"", b"", 5.0)
    assert await anext(response.chunks()) == b"abc"
    response.close()
    await asyncio.wait_for(server.closed_by_client.wait(), 5)


async def test_large_bodies_whole_and_streamed_with_back_pressure(raw: RawFactory) -> None:
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB, over the pause threshold

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            await read_request(reader)
            writer.write(answer(big))
            await writer.drain()

    _, pool = await raw(handler)
    assert await (await pool.post("/x", b"", b"", 5.0)).read() == big
    pieces = [piece async for piece in (await pool.post("/x", b"", b"", 5.0)).chunks()]
    assert b"".join(pieces) == big


# ---- Call: the callback-driven exchange of the router's fast path ----


async def call(pool: UpstreamPool, timeout_s: float = 5.0, body: bytes = b"{}") -> Call:
    """One Call, awaited through its on_done callback."""
    done: asyncio.Future[Call] = asyncio.get_running_loop().create_future()
    pool.call(b"/v1/completions", b"X-Request-Id: c1\r\n", body, Deadlines(timeout_s), done.set_result)
    async with asyncio.timeout(5):
        return await done


async def test_call_reads_whole_answers_in_one_piece_and_in_many(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        server.requests.append(await read_request(reader))
        writer.write(answer(b'{"one": "piece"}', b"Connection: keep-alive\r\n"))
        server.requests.append(await read_request(reader))
        for byte in answer(b'{"byte": "by byte"}'):
            writer.write(bytes([byte]))
            await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        await reader.read()

    server, pool = await raw(handler)
    first, second, third = await call(pool), await call(pool), await call(pool)
    assert (first.status, first.body, first.error) == (200, b'{"one": "piece"}', None)
    assert (second.status, second.body) == (200, b'{"byte": "by byte"}')
    assert (third.status, third.body) == (201, b"abc")
    assert server.connections == 1  # kept alive across all three
    assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert server.requests[0].endswith(b"Content-Length: 2\r\nX-Request-Id: c1\r\n\r\n{}")


async def test_call_answer_with_connection_close_is_not_reused(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b"bye", b"Connection: close\r\n"))
        await reader.read()

    server, pool = await raw(handler)
    assert [(c.status, c.body) for c in (await call(pool), await call(pool))] == [(200, b"bye")] * 2
    assert server.connections == 2


async def test_call_on_a_stale_keep_alive_connection_is_sent_again(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        await read_request(reader)
        writer.write(answer(b"first" if index == 1 else b"fresh"))
        await writer.drain()
        if index == 1:
            await read_request(reader)  # takes the second request, then closes without answering

    server, pool = await raw(handler)
    assert (await call(pool)).body == b"first"
    again = await call(pool)
    assert (again.status, again.body, again.error) == (200, b"fresh", None)
    assert server.connections == 2


async def test_call_to_a_refused_port_fails_with_connect_failed() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    failed = await call(UpstreamPool("127.0.0.1", port, 2.0))
    assert isinstance(failed.error, ConnectFailed)


async def test_call_times_out_and_drops_the_connection(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        if not await reader.read():  # never answers; b"" once the client gives up
            server.closed_by_client.set()

    server, pool = await raw(handler)
    late = await call(pool, timeout_s=0.2)
    assert isinstance(late.error, TimeoutError)
    await asyncio.wait_for(server.closed_by_client.wait(), 5)


async def test_call_broken_mid_answer_is_disconnected(raw: RawFactory) -> None:
    _, pool = await raw(answers_part_of_the_body)
    broken = await call(pool)
    assert isinstance(broken.error, Disconnected)
    assert not broken.error.before_head


async def test_closed_call_drops_its_connection_and_reports_nothing(raw: RawFactory) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        arrived.set()
        if not await reader.read():
            server.closed_by_client.set()

    arrived = asyncio.Event()
    server, pool = await raw(handler)
    reports: list[Call] = []
    abandoned = pool.call(b"/x", b"", b"", Deadlines(0.3), reports.append)
    await asyncio.wait_for(arrived.wait(), 5)
    abandoned.close()
    await asyncio.wait_for(server.closed_by_client.wait(), 5)
    assert (await call(pool, timeout_s=0.3)).error is not None  # a later call's timer fires as usual
    assert reports == []  # the closed call's timer was cancelled with it


async def test_deadlines_time_out_each_call_on_time_behind_a_long_one(raw: RawFactory) -> None:
    """One timer for many calls: a slow call at the head of the line times out at its own deadline,
    finished calls behind it are swept out, and a slow call started later times out at its own."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while True:
            request = await read_request(reader)
            if request.endswith(b"slow"):
                await reader.read()  # never answers
                return
            writer.write(answer(b"quick"))

    _, pool = await raw(handler)
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(0.5)
    ended: dict[str, tuple[float, Call]] = {}
    both_ended = asyncio.Event()

    def ending(name: str) -> Callable[[Call], None]:
        def done(call: Call) -> None:
            ended[name] = (loop.time(), call)
            if len(ended) == 2:
                both_ended.set()

        return done

    first = pool.call(b"/x", b"", b"slow", deadlines, ending("first"))
    for _ in range(300):
        quick: asyncio.Future[Call] = loop.create_future()
        pool.call(b"/x", b"", b"", deadlines, quick.set_result)
        assert (await asyncio.wait_for(quick, 5)).body == b"quick"
    assert deadlines.tracked <= 2 * 1 + 64 + 1  # the finished ones do not pile up behind `first`
    second = pool.call(b"/x", b"", b"slow", deadlines, ending("second"))
    await asyncio.wait_for(both_ended.wait(), 5)
    for name, call in (("first", first), ("second", second)):
        at, reported = ended[name]
        assert reported is call
        assert isinstance(call.error, TimeoutError)
        assert at >= call.deadline
    assert first.deadline < second.deadline
    assert ended["first"][0] < ended["second"][0]
    assert deadlines.tracked == 0
