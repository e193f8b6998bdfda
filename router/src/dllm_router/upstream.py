"""A lean HTTP/1.1 client for the hot path: keep-alive connections per engine pod, on asyncio protocols.

The router makes two upstream calls per prompt, so the client's cost per call is most of the router's
own. aiohttp's client spent about half of the router's CPU time in profiles (request objects, header
multidicts, URL handling, stream readers); this one writes each request with one `write` and parses
answers incrementally (Content-Length, chunked, or until close), handing body bytes to the reader as
they come. Health checks and /v1/models still use aiohttp.

Errors: `ConnectFailed` (nothing was sent: the pod is down), `Disconnected` (the connection ended before
the whole answer), `BadResponse`; a timeout raises TimeoutError. A request that meets a keep-alive
connection the pod had already closed is resent once on a fresh connection.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable

MAX_HEAD = 64 * 1024
MAX_LINE = 4096  # a chunk-size line, extensions included
PAUSE_AT = 1024 * 1024  # bytes buffered for a slow reader before the socket is paused
IDLE_S = 4.0  # below uvicorn's (vLLM's) 5 s keep-alive, so an idle connection is not reused as it closes
MAX_IDLE = 512


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    pass


class Disconnected(UpstreamError):
    def __init__(self, message: str, before_head: bool) -> None:
        super().__init__(message)
        self.before_head = before_head


class BadResponse(UpstreamError):
    pass


class Response:
    """One answer: `status` is known; the body arrives through read() or chunks()."""

    def __init__(self, conn: _Connection, deadline: float) -> None:
        self._conn: _Connection | None = conn
        # one timer for the whole exchange: cheaper than a timeout context around every wait
        self._timer = conn.loop.call_at(deadline, conn.expire)
        self.status = 0
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.done = False
        self._error: BaseException | None = None
        self._streaming = False  # a reader of chunks() gets back-pressure; read() takes the body whole

    # called by the connection
    def _head_ready(self, status: int) -> None:
        self.status = status
        if not self._head.done():
            self._head.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)
        if self._streaming and self._buffered > PAUSE_AT and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.done = True
        self._conn = None
        self._timer.cancel()
        self._wake()

    def _whole(self, status: int, body: bytes) -> None:
        self._head_ready(status)
        self._feed(body)
        self._finish()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._conn = None
        self._timer.cancel()
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved by wait_head, or never needed
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # used by the router
    async def wait_head(self) -> None:
        await self._head

    def _take(self) -> bytes:
        data = self._pieces.popleft() if len(self._pieces) == 1 else b"".join(self._pieces)
        self._pieces.clear()
        self._buffered = 0
        if self._conn is not None:
            self._conn.resume()
        return data

    async def _wait(self) -> None:
        if self._conn is None:
            raise RuntimeError("the body ended without data or an error")  # cannot happen
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked framing removed), joined per wake-up."""
        self._streaming = True
        while True:
            if self._pieces:
                yield self._take()
            elif self.done:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    async def read(self) -> bytes:
        while not self.done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._take() if self._pieces else b""

    def close(self) -> None:
        """Drop the connection unless the answer is complete (the engine then aborts the request)."""
        self._timer.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Deadlines:
    """The time limit of many calls, kept with one timer instead of one per call (starting and
    cancelling a uvloop timer costs a few microseconds, twice per request). Every call here has the
    same limit, so deadlines come in the order calls start: the calls wait in a FIFO, and the timer is
    set for the oldest. When it fires, the calls past their deadline time out, finished ones are
    dropped, and it is set again for the oldest left. Finished calls are also swept out whenever they
    outnumber the unfinished ones, so a long call at the head does not make the FIFO grow."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._calls: deque[Call] = deque()
        self._open = 0  # unfinished calls in _calls
        self._timer: asyncio.TimerHandle | None = None

    def add(self, call: Call, loop: asyncio.AbstractEventLoop) -> float:
        """Track `call`; returns its deadline (on the loop's clock)."""
        deadline = loop.time() + self.limit_s
        call.deadline = deadline
        calls = self._calls
        calls.append(call)
        self._open += 1
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire_due)
        elif len(calls) > 2 * self._open + 64:
            self._calls = deque(c for c in calls if c.open)
        return deadline

    def finished(self) -> None:
        self._open -= 1

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def tracked(self) -> int:
        """Calls held (unfinished ones, and finished ones not yet swept out)."""
        return len(self._calls)

    def _expire_due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._calls:  # self._calls, not a local: expiring a call may add (and sweep) calls
            call = self._calls[0]
            if call.open and call.deadline > now:
                self._timer = loop.call_at(call.deadline, self._expire_due)
                return
            self._calls.popleft()
            if call.open:
                call._expire()


class Call:
    """One POST driven by callbacks, for the router's fast path: no task, no future, no timer.

    `on_done(call)` runs once: when the whole answer is in (`status`, `body`), or when it failed
    (`error`: an UpstreamError, or TimeoutError past its deadline, kept by `Deadlines`). The rules are
    `UpstreamPool.post`'s: the time limit runs from the start to the last byte, and a request that
    meets a keep-alive connection the pod had closed is sent once more on another connection. Only a
    pool with no idle connection makes a task (to connect). `close()` abandons the call: its
    connection is closed (the engine then aborts the request) and `on_done` is not called.
    """

    __slots__ = (
        "_conn",
        "_connecting",
        "_deadlines",
        "_message",
        "_on_done",
        "_pieces",
        "_pool",
        "_resent",
        "_reused",
        "body",
        "deadline",
        "error",
        "status",
    )

    def __init__(
        self,
        pool: UpstreamPool,
        message: bytes,
        deadlines: Deadlines,
        on_done: Callable[[Call], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._pool, self._message, self._deadlines = pool, message, deadlines
        self._on_done: Callable[[Call], None] | None = on_done
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._pieces: list[bytes] = []
        self._reused = self._resent = False
        self.status = 0
        self.body = b""
        self.error: BaseException | None = None
        self.deadline = 0.0
        self._send(deadlines.add(self, loop) - deadlines.limit_s)

    @property
    def open(self) -> bool:
        return self._on_done is not None

    def _send(self, now: float) -> None:
        conn = self._pool._checkout(now)
        if conn is None:
            self._reused = False
            self._connecting = asyncio.ensure_future(self._connect_and_send())
            return
        self._reused, self._conn = True, conn
        conn.send(self._message, self)

    async def _connect_and_send(self) -> None:
        try:
            conn = await self._pool._connect()
        except ConnectFailed as e:
            self._connecting = None
            self._report(e)
            return
        self._connecting = None
        self._conn = conn
        conn.send(self._message, self)

    # called by the connection, as on a Response
    def _head_ready(self, status: int) -> None:
        self.status = status

    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)

    def _finish(self) -> None:
        pieces = self._pieces
        self.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._report(None)

    def _whole(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body
        self._report(None)

    def _fail(self, error: BaseException) -> None:
        self._conn = None
        if isinstance(error, Disconnected) and error.before_head and self._reused and not self._resent:
            self._resent = True  # the pod had closed this idle connection: send again
            self._pieces.clear()
            self._send(self._pool.loop_time())
            return
        self._report(error)

    def _expire(self) -> None:
        self._abandon()
        self._report(TimeoutError(f"{self._pool.name} did not answer in time"))

    def _report(self, error: BaseException | None) -> None:
        self._conn = None
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            self._deadlines.finished()
            self.error = error
            on_done(self)

    def _abandon(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn._sink = None
            conn.close()

    def close(self) -> None:
        """Abandon the call unless it is over; `on_done` will not run."""
        if self._on_done is not None:
            self._on_done = None
            self._deadlines.finished()
        self._abandon()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self._sink: Response | Call | None = None
        self._state = _IDLE
        self._remaining = 0
        self._keep_alive = True
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def send(self, data: bytes, sink: Response | Call) -> None:
        assert self.transport is not None
        self._sink, self._state, self._keep_alive = sink, _HEAD, True
        self.transport.write(data)

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def expire(self) -> None:
        self._fail(TimeoutError(f"{self.pool.name} did not answer in time"))

    def data_received(self, data: bytes) -> None:
        if self._sink is None:  # nothing was asked: a broken or chatty server
            self.close()
            return
        if self._state == _HEAD and not self._buf and self._take_whole(data):
            return
        self._buf += data
        try:
            self._parse()
        except BadResponse as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self.closed = True  # the pod is closing it: not to be taken from the pool meanwhile
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._sink is None:
            return
        if self._state == _UNTIL_CLOSE:
            self._done()
            return
        before_head = self._state == _HEAD
        where = "before its answer" if before_head else "in the middle of its answer"
        self._fail(Disconnected(f"{self.pool.name} closed the connection {where}: {exc!r}", before_head))

    def _fail(self, error: BaseException) -> None:
        sink, self._sink = self._sink, None
        self.close()
        if sink is not None:
            sink._fail(error)

    def _done(self) -> None:
        sink, self._sink = self._sink, None
        self._state = _IDLE
        if self._keep_alive and not self.closed and not self._buf:
            self.resume()  # a streamed answer's reader may have paused it
            self.pool.put_back(self)  # first: whoever the answer wakes may call this pod again
        else:
            self.close()
        if sink is not None:
            sink._finish()

    def _take_whole(self, data: bytes) -> bool:
        """The common answer in one piece: an HTTP/1.1 head with Content-Length and exactly that much
        body. Taken without copying through the buffer; False leaves anything else to `_parse`."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or not data.startswith(b"HTTP/1.1 2") or data[12:13] != b" ":
            return False
        code = data[9:12]
        low = data[:end].lower()
        length = _field(low, b"\r\ncontent-length:")
        if (
            not code.isdigit()
            or code == b"204"  # no body whatever the head says: the general parser's case
            or length is None
            or not length.isdigit()
            or len(data) != end + 4 + int(length)
            or b"\r\ntransfer-encoding:" in low
        ):
            return False
        connection = _field(low, b"\r\nconnection:")
        sink, self._sink = self._sink, None
        self._state = _IDLE
        if connection is None or b"close" not in connection:
            self.pool.put_back(self)
        else:
            self.close()
        assert sink is not None
        sink._whole(int(code), data[end + 4 :])
        return True

    def _parse(self) -> None:
        buf = self._buf
        while buf or self._state in (_DONE_LENGTH,):
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise BadResponse(f"{self.pool.name}: response head over {MAX_HEAD} bytes")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._start_body(head)
            elif state in (_LENGTH, _CHUNK_DATA, _UNTIL_CLOSE):
                take = len(buf) if state == _UNTIL_CLOSE else min(len(buf), self._remaining)
                assert self._sink is not None
                self._sink._feed(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if self._remaining == 0 and state != _UNTIL_CLOSE:
                    self._state = _DONE_LENGTH if state == _LENGTH else _CHUNK_END
            elif state == _DONE_LENGTH:
                self._done()
                return
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_LINE:
                        raise BadResponse(f"{self.pool.name}: chunk-size line over {MAX_LINE} bytes")
                    return
                size = chunk_size(bytes(buf[:end]))
                if size is None:
                    raise BadResponse(f"{self.pool.name}: bad chunk size {bytes(buf[:end])[:20]!r}")
                del buf[: end + 2]
                self._state, self._remaining = (_TRAILERS, 0) if size == 0 else (_CHUNK_DATA, size)
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise BadResponse(f"{self.pool.name}: trailer line over {MAX_HEAD} bytes")
                    return
                del buf[: end + 2]
                if end == 0:
                    self._done()
                    return
            else:
                raise BadResponse(f"{self.pool.name}: bytes after the answer")

    def _start_body(self, head: bytes) -> None:
        end = head.find(b"\r\n")
        parts = (head if end < 0 else head[:end]).split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"{self.pool.name}: not an HTTP/1.x answer: {head[:40]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real head follows
        low = head.lower()  # one pass; only the framing headers are read, by search, not split
        connection = _field(low, b"\r\nconnection:")
        self._keep_alive = (connection is None or b"close" not in connection) and (
            parts[0] == b"HTTP/1.1" or (connection is not None and b"keep-alive" in connection)
        )
        length = _field(low, b"\r\ncontent-length:")
        encoding = _field(low, b"\r\ntransfer-encoding:")
        if status in (204, 304):
            self._state, self._remaining = _DONE_LENGTH, 0
        elif encoding is not None and b"chunked" in encoding:
            self._state = _CHUNK_SIZE
        elif length is not None:
            if not length.isdigit():
                raise BadResponse(f"{self.pool.name}: bad Content-Length {length[:20]!r}")
            self._remaining = int(length)
            self._state = _LENGTH if self._remaining else _DONE_LENGTH
        else:
            self._state, self._keep_alive = _UNTIL_CLOSE, False
        assert self._sink is not None
        self._sink._head_ready(status)


_CHUNK_SIZE_RE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:;[^\r\n]*)?")


def chunk_size(line: bytes) -> int | None:
    """A chunk-size line's size: hex digits only, optionally `;extensions` (L7: `int(x, 16)` also took
    `-1`, `0x10`, `1_0` and spaces). None when the line is not that."""
    match = _CHUNK_SIZE_RE.fullmatch(line)
    return None if match is None else int(match.group(1), 16)


def _field(head: bytes, prefix: bytes) -> bytes | None:
    """The value of the first header line starting with `prefix` (`\\r\\nname:`), stripped."""
    start = head.find(prefix)
    if start < 0:
        return None
    start += len(prefix)
    end = head.find(b"\r\n", start)
    return (head[start:] if end < 0 else head[start:end]).strip()


_IDLE, _HEAD, _LENGTH, _DONE_LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE = range(9)


class UpstreamPool:
    """Keep-alive connections to one engine pod."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, tls: bool = False) -> None:
        self.host, self.port, self.connect_timeout_s = host, port, connect_timeout_s
        self._ssl = ssl.create_default_context() if tls else None
        self.name = f"{host}:{port}"
        authority = f"[{host}]:{port}" if ":" in host else self.name
        self._host_header = b"Host: " + authority.encode() + b"\r\n"
        self._idle: list[_Connection] = []
        self._closed = False  # the pod left: connections that finish their request are closed

    @property
    def idle(self) -> int:
        return len(self._idle)

    def put_back(self, conn: _Connection) -> None:
        if not self._closed and len(self._idle) < MAX_IDLE:
            conn.idle_since = conn.loop.time()
            self._idle.append(conn)
        else:
            conn.close()

    def _checkout(self, now: float) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            transport = conn.transport
            if (
                not conn.closed
                and now - conn.idle_since < IDLE_S
                and transport
                and not transport.is_closing()
            ):
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self._ssl
                )
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {self.name}: {e!r}") from e
        return conn

    def loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def call(
        self, path: bytes, headers: bytes, body: bytes, deadlines: Deadlines, on_done: Callable[[Call], None]
    ) -> Call:
        """Send a POST whose answer is read whole; `on_done(call)` runs when it is in or has failed."""
        message = b"".join(
            (b"POST ", path, b" HTTP/1.1\r\n", self._host_header, b"Content-Length: ", b"%d" % len(body),
             b"\r\n", headers, b"\r\n", body)
        )  # fmt: skip
        return Call(self, message, deadlines, on_done, asyncio.get_running_loop())

    async def post(self, path: str, headers: bytes, body: bytes, timeout_s: float) -> Response:
        """Send a POST (headers: preformatted `Name: value\\r\\n` lines); returns once the head is in."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + timeout_s
        message = (
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + self._host_header
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n" + headers + b"\r\n" + body
        )  # fmt: skip
        for attempt in range(2):
            conn = self._checkout(now)
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            response = Response(conn, deadline)
            conn.send(message, response)
            try:
                await response.wait_head()
            except Disconnected as e:
                if reused and e.before_head and attempt == 0:
                    continue  # the pod had closed this idle connection: send again on a new one
                raise
            except BaseException:
                conn.close()
                raise
            return response
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()
