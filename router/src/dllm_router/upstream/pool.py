"""Keep-alive connections to one engine pod, and the two ways to POST on them: `call` (callbacks, for the
fast path) and `post` (a coroutine returning a Response)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from dllm_router.upstream.call import Call
from dllm_router.upstream.connection import UpstreamConnection
from dllm_router.upstream.errors import ConnectFailed, Disconnected
from dllm_router.upstream.response import Response

if TYPE_CHECKING:
    from dllm_router.memory_budget import RequestBytes
    from dllm_router.upstream.deadlines import Deadlines

IDLE_S = 4.0  # below uvicorn's (vLLM's) 5 s keep-alive, so an idle connection is not reused as it closes
MAX_IDLE = 512


class UpstreamPool:
    """Keep-alive connections to one engine pod."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, tls: bool = False) -> None:
        self.host, self.port, self.connect_timeout_s = host, port, connect_timeout_s
        self._ssl = ssl.create_default_context() if tls else None
        self.name = f"{host}:{port}"
        authority = f"[{host}]:{port}" if ":" in host else self.name
        self._host_header = b"Host: " + authority.encode() + b"\r\n"
        self._idle: list[UpstreamConnection] = []
        self._closed = False  # the pod left: connections that finish their request are closed

    @property
    def idle(self) -> int:
        return len(self._idle)

    def put_back(self, conn: UpstreamConnection) -> None:
        if not self._closed and len(self._idle) < MAX_IDLE:
            conn.idle_since = conn.loop.time()
            self._idle.append(conn)
        else:
            conn.close()

    def checkout(self, now: float) -> UpstreamConnection | None:
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

    async def connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self), self.host, self.port, ssl=self._ssl
                )
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {self.name}: {e!r}") from e
        return conn

    def loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def call(
        self,
        path: bytes,
        headers: bytes,
        body: bytes,
        deadlines: Deadlines,
        on_done: Callable[[Call], None],
        ledger: RequestBytes | None = None,
    ) -> Call:
        """Send a POST whose answer is read whole; `on_done(call)` runs when it is in or has failed."""
        message = b"".join(
            (b"POST ", path, b" HTTP/1.1\r\n", self._host_header, b"Content-Length: ", b"%d" % len(body),
             b"\r\n", headers, b"\r\n", body)
        )  # fmt: skip
        return Call(self, message, deadlines, on_done, asyncio.get_running_loop(), ledger)

    async def post(
        self, path: str, headers: bytes, body: bytes, timeout_s: float, ledger: RequestBytes | None = None
    ) -> Response:
        """Send a POST (headers: preformatted `Name: value\\r\\n` lines); returns once the head is in."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + timeout_s
        message = (
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + self._host_header
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n" + headers + b"\r\n" + body
        )  # fmt: skip
        for attempt in range(2):
            conn = self.checkout(now)
            reused = conn is not None
            if conn is None:
                conn = await self.connect()
            response = Response(conn, deadline, ledger)
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
