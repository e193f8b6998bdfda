"""One POST of the fast path, driven by callbacks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from dllm_router.upstream.errors import ConnectFailed, Disconnected, UpstreamError

if TYPE_CHECKING:
    from dllm_router.memory_budget import RequestBytes
    from dllm_router.upstream.connection import UpstreamConnection
    from dllm_router.upstream.deadlines import Deadlines
    from dllm_router.upstream.pool import UpstreamPool


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
        "_ledger",
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
        ledger: RequestBytes | None = None,
    ) -> None:
        self._pool, self._message, self._deadlines = pool, message, deadlines
        self._ledger = ledger  # NEW-1: the answer's bytes are charged to its request as they arrive
        self._on_done: Callable[[Call], None] | None = on_done
        self._conn: UpstreamConnection | None = None
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
        conn = self._pool.checkout(now)
        if conn is None:
            self._reused = False
            self._connecting = asyncio.ensure_future(self._connect_and_send())
            return
        self._reused, self._conn = True, conn
        conn.send(self._message, self)

    async def _connect_and_send(self) -> None:
        try:
            conn = await self._pool.connect()
        except ConnectFailed as e:
            self._connecting = None
            self._report(e)
            return
        self._connecting = None
        self._conn = conn
        conn.send(self._message, self)

    # the connection's calls (AnswerSink, connection.py), as on a Response
    def head_ready(self, status: int) -> None:
        self.status = status

    def feed(self, data: bytes) -> None:
        if self._ledger is not None:
            self._ledger.charge(len(data))  # over: raises, and the connection fails the call
        self._pieces.append(data)

    def finish(self) -> None:
        pieces = self._pieces
        self.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._report(None)

    def whole(self, status: int, body: bytes) -> None:
        self.status = status
        if self._ledger is not None:
            try:
                self._ledger.charge(len(body))
            except UpstreamError as e:
                self._report(e)
                return
        self.body = body
        self._report(None)

    def fail(self, error: BaseException) -> None:
        self._conn = None
        if isinstance(error, Disconnected) and error.before_head and self._reused and not self._resent:
            self._resent = True  # the pod had closed this idle connection: send again
            self._pieces.clear()
            self._send(self._pool.loop_time())
            return
        self._report(error)

    def expire(self) -> None:
        self._abandon()
        self._report(TimeoutError(f"{self._pool.name} did not answer in time"))

    def _report(self, error: BaseException | None) -> None:
        self._conn = None
        if error is not None:
            self._pieces.clear()
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
            conn.sink = None
            conn.close()

    def close(self) -> None:
        """Abandon the call unless it is over; `on_done` will not run."""
        if self._on_done is not None:
            self._on_done = None
            self._deadlines.finished()
        self._abandon()
