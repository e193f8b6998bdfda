"""The connections a side channel holds before they authenticated: a few, the oldest evicted (NEW-7).

A connection that says nothing holds its place until the handshake's deadline. Were new connections
refused while the pool is full, a host that reaches the port could keep every legitimate peer out by
opening a few silent ones every deadline; evicting the oldest instead means it would have to open
connections faster than a peer completes its one-round-trip handshake.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

# How long a new connection waits for an evicted one to leave (its thread wakes at once, see `enter`).
_ROOM_TIMEOUT_S = 1.0


@dataclass(eq=False)
class PreAuthEntry:
    """One connection in its handshake; `evicted` once the pool made room for a newer one with it."""

    sock: socket.socket
    evicted: bool = False


class PreAuthPool:
    """At most `size` connections in their handshake; a new one evicts the oldest that is not yet."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("the pre-authentication pool needs at least one place")
        self._size = size
        self._entries: dict[PreAuthEntry, None] = {}  # in arrival order
        self._changed = threading.Condition()

    def enter(self, sock: socket.socket) -> PreAuthEntry | None:
        """A place for `sock`, evicting the oldest connections as needed; None if none left in time.

        An evicted connection's socket is shut for reading, which wakes its handshake thread at once
        (its read ends); the thread answers it and leaves, and this call goes on.
        """
        deadline = time.monotonic() + _ROOM_TIMEOUT_S
        with self._changed:
            while len(self._entries) >= self._size:
                oldest = next((entry for entry in self._entries if not entry.evicted), None)
                if oldest is not None:
                    oldest.evicted = True
                    with contextlib.suppress(OSError):
                        oldest.sock.shutdown(socket.SHUT_RD)
                left = deadline - time.monotonic()
                if left <= 0 or not self._changed.wait(left):
                    return None
            entry = PreAuthEntry(sock)
            self._entries[entry] = None
            return entry

    def leave(self, entry: PreAuthEntry) -> bool:
        """The connection is done with its handshake; False if it was evicted (it may not go on).

        After a call that returned True the entry can no longer be evicted.
        """
        with self._changed:
            if self._entries.pop(entry, 0) is None:
                self._changed.notify_all()
            return not entry.evicted

    @property
    def size(self) -> int:
        with self._changed:
            return len(self._entries)
