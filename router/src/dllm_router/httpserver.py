"""A small HTTP/1.1 server for the router's hot path: asyncio protocols and httptools' C parser (llhttp).

aiohttp's server cost the router 80-100 us per request in profiles, even for a handler returning a
constant (request objects, header multidicts, payload streams, a task and several futures per request).
This one parses with llhttp, keeps headers as a plain dict of lowercased bytes, hands the handler the
whole body, and writes each answer with one `write`. A route may also have a `FastHandler`, called
with the complete request from the parser's callback, which answers by callbacks (no task per request)
or hands the request to a task. What a handler gets and gives back (Request, Response, StreamWriter)
is in `http_messages.py`; this module is the connection that parses and writes them, and the server.

Behaviour a client sees:
- keep-alive (HTTP/1.1 by default, HTTP/1.0 on request); pipelined requests are answered in order,
  one at a time per connection; a `Connection: close` request closes after its answer;
- request bodies by Content-Length or chunked; over `max_body` the answer is 413 (before the body is read
  when its length is declared) and the connection is closed; `Expect: 100-continue` gets `100 Continue`
  when the request is next in line and its body is within the limit;
- a malformed request gets 400 (an over-long head 431) and the connection is closed; the head's size is
  counted before its bytes reach the parser (H1), so one unterminated header cannot grow;
- a head must arrive within `head_timeout_s` of its first byte and a body within `body_timeout_s` of
  its head, else 408 and close (M1); above `max_connections` open connections a new one gets 503 and
  is closed;
- write back-pressure (H3): while the transport's writes are paused (the client does not read), no
  further request is read or started; a connection whose writes stay paused for `write_timeout_s` is
  aborted, as is an idle one whose answer never drained;
- streamed answers use chunked transfer encoding (raw bytes until close for HTTP/1.0 clients), and a
  writer waits while the client does not read (the transport's pause_writing / resume_writing);
- a client that closes its connection cancels the handler of its request (as aiohttp's
  `handler_cancellation`), so the router's upstream calls are cancelled too;
- `cleanup(drain_s)` stops listening, closes idle connections, lets requests in flight finish (each
  connection closes after its answer) for up to `drain_s`, then cancels the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from time import time

import httptools

from dllm_router.http_messages import Request, Response, StreamWriter, format_headers

# The server's API: its messages (http_messages.py) are part of it, so a handler's module may import
# everything from here.
__all__ = [
    "MAX_HEAD",
    "Connection",
    "ErrorPage",
    "FastHandler",
    "Handler",
    "HttpServer",
    "Pending",
    "Request",
    "Response",
    "StreamWriter",
    "plain_error",
    "status_line",
]

log = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # request line and headers
MAX_PIPELINE = 16  # requests queued on one connection before it stops reading
KEEPALIVE_S = 75.0  # idle keep-alive connections are closed after this (aiohttp's default)
LINGER_S = 2.0  # after a refusal, unread request bytes are drained this long so the client sees the answer
HEAD_TIMEOUT_S = 10.0  # a request head, from its first byte
BODY_TIMEOUT_S = 60.0  # a request body, from the end of its head
WRITE_TIMEOUT_S = 60.0  # writes paused this long (the client reads nothing): the connection is aborted


Handler = Callable[[Request], Awaitable[Response | StreamWriter]]


class Pending:
    """Work on a request answered by callbacks instead of a task (see `FastHandler`). The connection
    calls `cancel()` when the client leaves before the answer."""

    __slots__ = ()

    def cancel(self) -> None:
        raise NotImplementedError


# Takes a complete request. Returns None when it took the request: it answers with
# `conn.reply(request, response)` (now or from a callback; `conn.pending` holds its work meanwhile), or
# `conn.reply_internal_error(request)`; or returns the awaitable to run as a task, as a `Handler`'s.
FastHandler = Callable[[Request, "Connection"], Awaitable[Response | StreamWriter] | None]
ErrorPage = Callable[[int, str, Request | None], Response]


def plain_error(status: int, message: str, _: Request | None) -> Response:
    return Response(message.encode(), status=status, content_type="text/plain; charset=utf-8")


_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())
    return line


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them one at a time in arrival order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.write_paused = False
        self.idle_since = self.loop.time()
        self._queue: deque[Request] = deque()  # parsed (or being read) requests; the head is answered next
        self._current: Request | None = None  # the request whose head or body is being parsed
        self._head_size = 0
        self._task: asyncio.Task[None] | None = None
        self.pending: Pending | None = None  # a FastHandler's work in progress
        self._idle_waiter: asyncio.Future[None] | None = None  # cleanup() waiting for `pending`
        self._drain: asyncio.Future[None] | None = None
        self._refused = False  # parsing stopped: what follows is drained, not read
        self._read_paused = False
        self._over_cap = False  # refused at connect (too many connections): not in server.connections
        # H1: bytes fed to the parser since the current head began; a head ends at its blank line, so
        # data is fed in pieces that end there, and a head's bytes are counted before the parser sees them
        self._head_bytes = 0
        self._in_body = False  # between a head's end and its message's end
        self._body_left: int | None = None  # declared body bytes not yet read (None: chunked)
        self._head_began: float | None = None  # M1: when the pending head's first byte came
        self._body_began: float | None = None  # M1: when the pending body's head ended
        self._paused_since: float | None = None  # H3: when the transport paused our writes
        self._unfed: tuple[bytes, int] | None = None  # read but held back while not reading (H3)
        self._resuming = False

    # ---- transport callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._refuse_connection()
            return
        server.connections.add(self)

    def _refuse_connection(self) -> None:
        """Over the connection cap (M1): 503 at once, then close. Such connections are not counted as
        open, so lingering ones are bounded too: past the cap again they are cut without an answer."""
        server = self.server
        self._over_cap = self._refused = True
        if server.lingering >= server.max_connections:
            assert self.transport is not None
            self.transport.abort()
            return
        server.lingering += 1
        server.refused_connections += 1
        request = Request()
        request.keep_alive = False
        message = f"too many connections (over {server.max_connections}, --max-connections)"
        self._write_whole(request, self._error_page(503, message, None))
        self._linger()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: discard
        now = self.idle_since = self.loop.time()  # a head that stalls (no request queued yet) is swept too
        if self._unfed is not None:  # cannot happen while reading is paused; kept in order regardless
            raw, pos = self._unfed
            self._unfed = None
            data = raw[pos:] + data
        self._consume(data, 0, now)

    def _consume(self, raw: bytes, pos: int, now: float) -> None:
        """Feed `raw[pos:]` to the parser piece by piece: a head's bytes are counted before the parser
        sees them, and what follows a head or a declared body waits while reading is held back."""
        view = memoryview(raw)
        size = len(raw)
        while pos < size:
            if self._refused or self.closed:
                return
            if self._holding():
                self._unfed = (raw, pos)
                self._update_reading()
                return
            if self._in_body:
                left = self._body_left
                end = size if not left else min(size, pos + left)
            else:
                if self._head_began is None:
                    self._head_began = now
                budget = MAX_HEAD + 1 - self._head_bytes
                blank = raw.find(b"\r\n\r\n", pos, pos + budget + 3)
                end = min(size, pos + budget) if blank < 0 else blank + 4
            in_head = not self._in_body
            self._feed(view[pos:end])
            if in_head and self._head_began is not None and not self._refused:
                self._head_bytes += end - pos  # the head is still open: all of the piece was head
                if self._head_bytes > MAX_HEAD:
                    self._refuse(431, f"request head over {MAX_HEAD} bytes")
                    return
            pos = end

    def _feed(self, data: memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Refusal):
                self._refuse(cause.status, str(cause))
            else:
                log.exception("HTTP request callback failed")
                self._refuse(500, "internal error while reading the request")
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")

    def eof_received(self) -> bool:
        return False  # the client is gone (as aiohttp): close; connection_lost cancels its request

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._over_cap:
            self.server.lingering -= 1
        self.server.connections.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: its handler (and upstream calls) stop
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.cancel()
        self._wake_idle_waiter()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
            self._drain.exception()  # retrieved: the writer may already be cancelled
        self._queue.clear()
        self._unfed = None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._paused_since = self.loop.time()
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and not self.transport.is_closing():
            self._paused_since = None  # a closing connection's rest keeps its deadline
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None
        self._update_reading()
        self._advance()  # a request held back while the client was not reading

    # ---- reading, held back while answers pile up (H3) ----

    def _holding(self) -> bool:
        return self.write_paused or len(self._queue) > MAX_PIPELINE

    def _update_reading(self) -> None:
        """Pause reading while holding back; resume (after feeding what was held) once not."""
        if self.closed or self.transport is None:
            return
        if self._holding() and not self._refused:
            if not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()
        elif self._read_paused and not self._resuming:
            self._resuming = True
            self.loop.call_soon(self._resume_reading)  # never inside a parser callback

    def _resume_reading(self) -> None:
        self._resuming = False
        if self.closed or (self._holding() and not self._refused):
            return
        unfed, self._unfed = self._unfed, None
        if unfed is not None and not self._refused:
            self._consume(*unfed, self.loop.time())
        held = self._holding() and not self._refused
        if self._unfed is None and self._read_paused and not self.closed and not held:
            self._read_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    def check_deadlines(self, now: float) -> None:
        """The sweep's look at this connection: write, head, body and keep-alive limits."""
        server = self.server
        if self._paused_since is not None and now - self._paused_since > server.write_timeout_s:
            self.abort()  # the client has read nothing for that long: drop what it never took
            return
        if self._read_paused or self._refused:
            return  # not reading is our doing (or the connection is closing): the client is not late
        if self._head_began is not None and now - self._head_began > server.head_timeout_s:
            self._refuse(408, f"request head not complete within {server.head_timeout_s:g} s")
        elif self._body_began is not None and now - self._body_began > server.body_timeout_s:
            self._refuse(408, f"request body not complete within {server.body_timeout_s:g} s")
        elif not self.busy and now - self.idle_since > KEEPALIVE_S:
            self.close()

    # ---- parser callbacks ----

    def on_message_begin(self) -> None:
        self._current = Request(self)
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        assert self._current is not None
        self._current._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._count_head(len(name) + len(value))
        key = name.lower()
        headers = self._current.headers
        headers[key] = headers[key] + b", " + value if key in headers else value

    def on_headers_complete(self) -> None:
        request = self._current
        assert request is not None
        self._head_bytes, self._head_began = 0, None
        self._in_body, self._body_began = True, self.idle_since
        parser = self.parser
        request.method = parser.get_method().decode("ascii", errors="replace")
        request.keep_alive = parser.should_keep_alive()
        request.http10 = parser.get_http_version() == "1.0"
        path, _, query = request._url.partition(b"?")
        request.path = path.decode("latin-1")
        request.query = query.decode("latin-1")
        self._queue.append(request)
        self._update_reading()
        length = request.headers.get(b"content-length")
        self._body_left = None
        if length is not None:
            declared = _length(length)
            if declared > self.server.max_body:
                raise _Refusal(413, self.server.too_large)
            if b"transfer-encoding" not in request.headers:
                self._body_left = declared
        expect = request.headers.get(b"expect")
        if expect is not None:
            if expect.lower() != b"100-continue":
                raise _Refusal(417, "only 'Expect: 100-continue' is supported")
            request.expect_continue = True
        self._advance()

    def on_body(self, body: bytes) -> None:
        request = self._current
        assert request is not None
        request._size += len(body)
        if self._body_left is not None:
            self._body_left -= len(body)
        if request._size > self.server.max_body:
            raise _Refusal(413, self.server.too_large)
        request._pieces.append(body)

    def on_message_complete(self) -> None:
        request = self._current
        assert request is not None
        self._current = None
        self._in_body, self._body_began, self._body_left = False, None, None
        pieces = request._pieces
        request.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        request._pieces = []
        request.complete = True
        self._advance()

    def _count_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > MAX_HEAD:
            raise _Refusal(431, f"request head over {MAX_HEAD} bytes")

    # ---- answering, in order ----

    def _advance(self) -> None:
        """Start on the request at the head of the line, if nothing is being answered now."""
        if self._task is not None or self.pending is not None or not self._queue or self.closed:
            return
        if self.write_paused:
            return  # H3: the client is not reading; resume_writing starts the next one
        request = self._queue[0]
        if request.refusal is not None:
            self._answer_refusal(request)
        elif request.complete:
            fast = self.server.fast_routes.get((request.method, request.path))
            if fast is None:
                self._task = self.loop.create_task(self._answer(request))
                return
            try:
                work = fast(request, self)
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                self.reply_internal_error(request)
                return
            if work is not None:
                self._task = self.loop.create_task(self._answer(request, work))
        elif request.expect_continue and not request.continued:
            request.continued = True
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _refuse(self, status: int, message: str) -> None:
        """Stop reading this connection; the refusal is answered in turn, then the connection closes."""
        self._refused = True
        request = self._current
        if request is None or request not in self._queue:
            request = request or Request()
            self._queue.append(request)
        request.refusal = (status, message)
        self._advance()

    def _answer_refusal(self, request: Request) -> None:
        assert request.refusal is not None
        status, message = request.refusal
        request.keep_alive = False
        self._write_whole(request, self._error_page(status, message, request if request.method else None))
        self._linger()

    def _error_page(self, status: int, message: str, request: Request | None) -> Response:
        try:
            return self.server.error_page(status, message, request)
        except Exception:
            log.exception("the error page for %d failed", status)
            return plain_error(status, message, None)

    def _linger(self) -> None:
        """Half-close, and read (discarding) for a while: closing with unread bytes would reset the
        connection, and the client could lose the answer before reading it."""
        transport = self.transport
        assert transport is not None
        self._refused = True
        self._queue.clear()
        self._unfed = None
        self._update_reading()  # reading resumes, to discard what the client still sends
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, self.close)
        else:
            self.close()

    async def _answer(self, request: Request, work: Awaitable[Response | StreamWriter] | None = None) -> None:
        try:
            result = await (self.server.dispatch(request) if work is None else work)
            if isinstance(result, Response):
                self._write_whole(request, result)
            elif not result.finished:
                request.keep_alive = False  # the handler stopped mid-stream: the framing is incomplete
        except (asyncio.CancelledError, ConnectionResetError):
            self.close()  # the client went away, or the server stopped waiting: nothing more to write
            return
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            request.keep_alive = False
            if not request.started:
                self._write_whole(request, self._error_page(500, "internal server error", request))
        finally:
            self._task = None
        self._request_done(request)

    def reply(self, request: Request, response: Response) -> None:
        """A FastHandler's answer (now, or when its work is done)."""
        self.pending = None
        if self.closed:
            return
        self._write_whole(request, response)
        self._request_done(request)

    def reply_internal_error(self, request: Request) -> None:
        """A FastHandler failed: 500 (unless it had begun answering), and the connection closes after."""
        self.pending = None
        request.keep_alive = False
        if not self.closed and not request.started:
            self._write_whole(request, self._error_page(500, "internal server error", request))
        self._request_done(request)

    def _request_done(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        if self.closed:
            return
        if not request.keep_alive or self.server.draining:
            self.close()
            return
        self._update_reading()
        if self._queue:
            self._advance()
        else:
            self.idle_since = self.loop.time()
        if self._idle_waiter is not None and not self.busy:
            self._wake_idle_waiter()

    def _wake_idle_waiter(self) -> None:
        waiter, self._idle_waiter = self._idle_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- writing ----

    def head(self, request: Request, status: int, headers: bytes) -> bytes:
        if self.server.draining:
            request.keep_alive = False
        if not request.keep_alive:
            connection = b"Connection: close\r\n"
        elif request.http10:
            connection = b"Connection: keep-alive\r\n"
        else:
            connection = b""
        return status_line(status) + self.server.date_line() + connection + headers + b"\r\n"

    def _write_whole(self, request: Request, page: Response) -> None:
        body = page.body
        headers = (
            _content_type_line(page.content_type)
            + b"Content-Length: %d\r\n" % len(body)
            + page.header_lines
            + format_headers(page.headers)
        )
        head = self.head(request, page.status, headers)
        request.started = True
        self.write(head if request.method == "HEAD" else head + body)

    def write(self, data: bytes) -> None:
        if not self.closed:
            assert self.transport is not None
            self.transport.write(data)

    async def drained(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._drain is None or self._drain.done():
            self._drain = self.loop.create_future()
        await self._drain

    def close(self) -> None:
        """Close after what is written has gone out; an answer that cannot go out is dropped."""
        transport = self.transport
        if not self.closed and transport is not None:
            if self._paused_since is None and transport.get_write_buffer_size():
                self._paused_since = self.loop.time()  # what is left must go out within write_timeout_s
            transport.close()

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.abort()

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self._task is not None or self.pending is not None

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def answering(self) -> asyncio.Future[None] | None:
        """What cleanup() waits on: the handler's task, or a future done when `pending` is answered."""
        if self._task is not None:
            return self._task
        if self.pending is None:
            return None
        if self._idle_waiter is None:
            self._idle_waiter = self.loop.create_future()
        return self._idle_waiter


class HttpServer:
    """Routes `(method, path)` to handlers; GET routes answer HEAD too. Other paths get 404, known
    paths with another method 405. `error_page(status, message, request)` renders the server's own
    refusals (400, 404, 405, 408, 413, 417, 431, 500, 503)."""

    loop: asyncio.AbstractEventLoop  # set by start()

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Handler],
        *,
        fast_routes: Mapping[tuple[str, str], FastHandler] | None = None,
        max_body: int,
        too_large: str = "request body too large",
        error_page: ErrorPage = plain_error,
        drain_s: float = 30.0,
        max_connections: int = 1024,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self.routes = dict(routes)
        for (method, path), handler in routes.items():
            if method == "GET":
                self.routes.setdefault(("HEAD", path), handler)
        self.fast_routes = dict(fast_routes or {})
        self._methods: dict[str, list[str]] = {}
        for method, path in self.routes:
            self._methods.setdefault(path, []).append(method)
        self.max_body = max_body
        self.too_large = too_large
        self.error_page = error_page
        self.drain_s = drain_s
        self.max_connections = max_connections
        self.head_timeout_s, self.body_timeout_s = head_timeout_s, body_timeout_s
        self.write_timeout_s = write_timeout_s
        self.connections: set[Connection] = set()
        self.lingering = 0  # connections refused over the cap, still closing
        self.refused_connections = 0
        self.draining = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._date = b""
        self._date_at = 0

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host, port, backlog=backlog)
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep_idle)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        assert self._server is not None
        return [sock.getsockname()[:2] for sock in self._server.sockets]

    def dispatch(self, request: Request) -> Awaitable[Response | StreamWriter]:
        handler = self.routes.get((request.method, request.path))
        if handler is not None:
            return handler(request)
        allowed = self._methods.get(request.path)
        if allowed is None:
            page = self.error_page(404, f"no route for {request.path}", request)
        else:
            page = self.error_page(405, f"{request.method} is not allowed on {request.path}", request)
            page.headers = {**(page.headers or {}), "Allow": ", ".join(sorted(allowed))}
        return _ready(page)

    def date_line(self) -> bytes:
        now = int(time())
        if now != self._date_at:
            self._date_at = now
            self._date = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._date

    def _sweep_every(self) -> float:
        """A deadline is noticed within a quarter of the shortest one (one timer, not one per request)."""
        shortest = min(KEEPALIVE_S, self.head_timeout_s, self.body_timeout_s, self.write_timeout_s)
        return max(shortest / 4, 0.01)

    def _sweep_idle(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in list(self.connections):
            conn.check_deadlines(now)
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep_idle)

    async def cleanup(self, drain_s: float | None = None) -> None:
        """Stop listening; requests in flight get `drain_s` seconds, then everything is closed."""
        drain_s = self.drain_s if drain_s is None else drain_s
        self.draining = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while True:
            tasks = {w for c in self.connections if (w := c.answering()) is not None}
            left = deadline - loop.time()
            if not tasks or left <= 0:
                break
            await asyncio.wait(tasks, timeout=left)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.close()  # connection_lost cancels a pending answer
        if self._server is not None:
            await self._server.wait_closed()


_CONTENT_TYPES: dict[str, bytes] = {}


def _content_type_line(content_type: str) -> bytes:
    line = _CONTENT_TYPES.get(content_type)
    if line is None:
        line = _CONTENT_TYPES[content_type] = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n"
    return line


async def _ready(page: Response) -> Response:
    return page


def _length(value: bytes) -> int:
    try:
        return int(value)
    except ValueError:
        raise _Refusal(400, "bad Content-Length") from None
