"""The HTTP server: its routes, listening, the sweep of connections' time limits, and a graceful stop."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from time import time

from dllm_router.http_messages import Request, Response, StreamWriter
from dllm_router.httpserver import limits
from dllm_router.httpserver.connection import Connection
from dllm_router.httpserver.handlers import ErrorPage, FastHandler, Handler, plain_error
from dllm_router.httpserver.state import ConnectionState


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
        first_byte_timeout_s: float | None = None,
        head_timeout_s: float = limits.HEAD_TIMEOUT_S,
        body_timeout_s: float = limits.BODY_TIMEOUT_S,
        write_timeout_s: float = limits.WRITE_TIMEOUT_S,
        body_ledger: Callable[[], limits.BodyLedger] | None = None,
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
        # Bodies being read are charged here piece by piece and given back once whole (the handler
        # charges the whole body again) or when the connection ends: slow uploads cannot hold
        # --max-connections x the body limit unseen.
        self.body_ledger = body_ledger
        self.too_large = too_large
        self.error_page = error_page
        self.drain_s = drain_s
        self.max_connections = max_connections
        self.head_timeout_s, self.body_timeout_s = head_timeout_s, body_timeout_s
        # NEW-5: a connection that says nothing holds a slot this long at most (never past the head's)
        self.first_byte_timeout_s = min(first_byte_timeout_s or head_timeout_s, head_timeout_s)
        self.write_timeout_s = write_timeout_s
        self.connections: set[Connection] = set()
        # Connections with no request in progress (silent since they opened, idle between requests, or
        # in a head not yet complete), by when they became so, oldest first: the ones a new connection
        # may take the slot of.
        self.idle: OrderedDict[ConnectionState, float] = OrderedDict()  # O(1) at both ends
        # A connection idle for less is not evicted: a client's first bytes may not have been read yet
        # (when evictions come in a burst, the newest would otherwise go before being heard).
        self.evict_grace_s = min(limits.EVICT_GRACE_S, self.first_byte_timeout_s / 2)
        self.evicted_connections = 0
        # Bodies being read and charged to body_ledger, by when each began, oldest first: when the
        # budget cannot take a body's next bytes, the oldest upload (past the grace) is refused to make
        # room, so uploads that stall cannot keep everyone else out until the body timeout (NEW-1).
        self.uploads: OrderedDict[ConnectionState, float] = OrderedDict()
        self.evicted_uploads = 0
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
        shortest = min(
            limits.KEEPALIVE_S, self.first_byte_timeout_s, self.body_timeout_s, self.write_timeout_s
        )
        return max(shortest / 4, 0.01)

    def evict_idle(self) -> bool:
        """Close the connection idle longest to make room for a new one (NEW-5); False when every open
        connection has a request in progress or became idle within the grace."""
        young = self.loop.time() - self.evict_grace_s
        while self.idle:
            oldest, since = next(iter(self.idle.items()))
            if since > young:
                return False
            del self.idle[oldest]
            if oldest.evict():
                self.evicted_connections += 1
                return True
        return False

    def evict_upload(self, needing: ConnectionState, why: str) -> bool:
        """Refuse (503 `why`) the upload that began longest ago, but `needing` and any within the grace,
        giving its bytes back to the budget; False when there is none."""
        young = self.loop.time() - self.evict_grace_s
        for upload, began in self.uploads.items():
            if began > young:
                return False  # the rest began later still
            if upload is not needing:
                upload.refuse_upload(why)
                self.evicted_uploads += 1
                return True
        return False

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


async def _ready(page: Response) -> Response:
    return page
