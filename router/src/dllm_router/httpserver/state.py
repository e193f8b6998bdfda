"""What one client connection knows: its transport, its requests in line, and where reading stands.

A connection is one class built in layers, each on the one before and each in its own module: this
state, writing (writing.py), reading (reading.py), and its life (connection.py: the transport's
callbacks and the answers). One class keeps the hot path's calls plain method calls.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import httptools

from dllm_router.http_messages import Request
from dllm_router.httpserver.handlers import Pending
from dllm_router.httpserver.limits import BodyLedger

if TYPE_CHECKING:
    from dllm_router.httpserver.server import HttpServer


class ConnectionState(asyncio.Protocol):
    """A connection's fields; the layers above read and change them."""

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
        self._spoke = False  # a request began on it (else the first-byte deadline applies: NEW-5)
        # H1: bytes fed to the parser since the current head began; a head ends at its blank line, so
        # data is fed in pieces that end there, and a head's bytes are counted before the parser sees them
        self._head_bytes = 0
        self._in_body = False  # between a head's end and its message's end
        self._body_left: int | None = None  # declared body bytes not yet read (None: chunked)
        self._body_charge: BodyLedger | None = None  # the body being read, as charged (NEW-1)
        self._head_began: float | None = None  # M1: when the pending head's first byte came
        self._body_began: float | None = None  # M1: when the pending body's head ended
        self._paused_since: float | None = None  # H3: when the transport paused our writes
        self._unfed: tuple[bytes, int] | None = None  # read but held back while not reading (H3)
        self._resuming = False

    def _give_back_body(self) -> None:
        charge, self._body_charge = self._body_charge, None
        if charge is not None:
            self.server.uploads.pop(self, None)
            charge.release()

    def refuse_upload(self, why: str) -> None:
        """Give up the body being read to make room in the budget (server.evict_upload); `why` is the
        budget's refusal, which the client gets."""
        raise NotImplementedError

    def evict(self) -> bool:
        """Close to give the slot to a new connection, unless a request is in progress (connection.py)."""
        raise NotImplementedError
