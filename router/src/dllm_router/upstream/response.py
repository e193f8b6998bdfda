"""One answer read by the router's coroutines: its status, then its body whole or as it arrives."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from dllm_router.upstream.errors import UpstreamError

if TYPE_CHECKING:
    from dllm_router.memory_budget import RequestBytes
    from dllm_router.upstream.connection import UpstreamConnection

PAUSE_AT = 1024 * 1024  # bytes buffered for a slow reader before the socket is paused


class Response:
    """One answer: `status` is known; the body arrives through read() or chunks()."""

    def __init__(self, conn: UpstreamConnection, deadline: float, ledger: RequestBytes | None = None) -> None:
        self._conn: UpstreamConnection | None = conn
        self._ledger = ledger  # NEW-1: an answer read whole is charged to its request as it arrives
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

    # the connection's calls (AnswerSink, connection.py)
    def head_ready(self, status: int) -> None:
        self.status = status
        if not self._head.done():
            self._head.set_result(None)

    def feed(self, data: bytes) -> None:
        if self._ledger is not None:
            self._ledger.charge(len(data))  # over: raises, and the connection fails the answer
        self._pieces.append(data)
        self._buffered += len(data)
        if self._streaming and self._buffered > PAUSE_AT and self._conn is not None:
            self._conn.pause()
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._conn = None
        self._timer.cancel()
        self._wake()

    def whole(self, status: int, body: bytes) -> None:
        self.head_ready(status)
        try:
            self.feed(body)
        except UpstreamError as e:
            self.fail(e)
            return
        self.finish()

    def fail(self, error: BaseException) -> None:
        self._error = error
        if not self._streaming:  # never read: dropped now, not when a traceback's cycle is collected
            self._pieces.clear()
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
        self._pieces.clear()  # NEW-1: given back to the budget with its request, so dropped now
        if self._conn is not None:
            self._conn.close()
            self._conn = None
