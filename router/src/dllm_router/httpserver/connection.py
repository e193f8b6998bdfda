"""One client connection's life: its transport's callbacks (opened, taking an idle connection's slot
or refused over the connection cap; closed; writes paused and resumed), its requests answered one at a
time in arrival order (by a handler's task or a FastHandler's callbacks, or the server's own refusal,
then lingering), and the sweep's check of its time limits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from dllm_router.http_messages import Request, Response, StreamWriter
from dllm_router.httpserver import limits
from dllm_router.httpserver.handlers import plain_error
from dllm_router.httpserver.reading import ReadingConnection

log = logging.getLogger("dllm_router.httpserver")  # one logger name for the whole server


class Connection(ReadingConnection):
    """One client connection: parses requests, answers them one at a time in arrival order."""

    # ---- transport callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        server = self.server
        if len(server.connections) >= server.max_connections and not server.evict_idle():
            self._refuse_connection()
            return
        server.connections.add(self)
        server.idle[self] = self.idle_since

    def evict(self) -> bool:
        """Give this connection's slot to a new one (NEW-5), unless a request is in progress on it: it
        is closed (at once, dropping an answer its client never read) and no longer counted."""
        if self.closed or self.busy or self.transport is None:
            return False
        self._refused = True  # nothing more is read from it
        self.server.connections.discard(self)
        if self.transport.get_write_buffer_size():
            self.abort()
        else:
            self.close()
        return True

    def _refuse_connection(self) -> None:
        """Every connection has a request in progress (M1, NEW-5): 503 at once, then close. Such
        connections are not counted as open, so lingering ones are bounded too: past the cap again they
        are cut without an answer."""
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

    def eof_received(self) -> bool:
        return False  # the client is gone (as aiohttp): close; connection_lost cancels its request

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._give_back_body()
        if self._over_cap:
            self.server.lingering -= 1
        self.server.connections.discard(self)
        self.server.idle.pop(self, None)
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
        elif not self.busy:
            # NEW-5: a connection that never began a request gets the first-byte deadline, not keep-alive's
            limit = limits.KEEPALIVE_S if self._spoke else server.first_byte_timeout_s
            if now - self.idle_since > limit:
                self.close()

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
        if not self._over_cap:
            self.server.idle[self] = self.loop.time()  # only closing now: a new connection may take its slot
        self._update_reading()  # reading resumes, to discard what the client still sends
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(limits.LINGER_S, self.close)
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
            self.server.idle[self] = self.loop.time()  # closing: a new connection may take its slot (NEW-5)
            self.close()
            return
        self._update_reading()
        if self._queue:
            self._advance()
        else:
            self.idle_since = self.server.idle[self] = self.loop.time()
        if self._idle_waiter is not None and not self.busy:
            self._wake_idle_waiter()

    def _wake_idle_waiter(self) -> None:
        waiter, self._idle_waiter = self._idle_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
