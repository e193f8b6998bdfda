"""The HTTP server's limits: sizes, and the time limits' defaults (HttpServer takes its own values)."""

from __future__ import annotations

from typing import Protocol


class BodyLedger(Protocol):
    """Where a request body's bytes are charged while it is read (the router's memory budget, NEW-1):
    a body is held in memory piece by piece long before its handler sees it."""

    def try_charge_body(self, n: int) -> str | None:
        """Charge `n` more bytes; None when charged, else why not (the client gets it in a 503)."""
        ...

    def release(self) -> None: ...


MAX_HEAD = 64 * 1024  # request line and headers
MAX_PIPELINE = 16  # requests queued on one connection before it stops reading
KEEPALIVE_S = 75.0  # idle keep-alive connections are closed after this (aiohttp's default)
LINGER_S = 2.0  # after a refusal, unread request bytes are drained this long so the client sees the answer
HEAD_TIMEOUT_S = 10.0  # a request head, from its first byte; and a new connection's first byte
BODY_TIMEOUT_S = 60.0  # a request body, from the end of its head
WRITE_TIMEOUT_S = 60.0  # writes paused this long (the client reads nothing): the connection is aborted
EVICT_GRACE_S = 0.25  # at the connection cap, a connection idle for less is not evicted (NEW-5)
