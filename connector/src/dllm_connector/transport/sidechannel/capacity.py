"""How many connections a side channel serves at once, and the slots that count them (NEW-7).

A prefill offer keeps its connection, and so its slot, until decode claims it (up to the hold), so
decode needs a slot for every offer of every request it may still claim: a request reaches one decode
rank from at most each prefill TP rank, and decode runs at most `max_num_seqs` of them at once.
"""

from __future__ import annotations

import threading
import time

# The floor of the slots past the handshake, whatever the engine's numbers: offers for requests decode
# has queued but not yet scheduled wait too, beyond max_num_seqs, and an engine of few sequences still
# takes the router's ends and the sends of a burst (64 was the one cap before it was sized).
MIN_CONNECTIONS = 64
# Connections still in their handshake (not yet authenticated): a peer's handshake takes one round trip,
# so a few suffice; a new one evicts the oldest (server.py), so silent sockets cannot keep them.
PRE_AUTH_CONNECTIONS = 16


def connections_for(max_num_seqs: int | None, senders_per_request: int) -> int:
    """The slots past the handshake for a decode rank that runs `max_num_seqs` requests at once, each
    sent by up to `senders_per_request` prefill TP ranks (an upper bound: with more prefill ranks than
    decode ranks each decode rank hears from some of them only); never below MIN_CONNECTIONS."""
    if max_num_seqs is None:
        return MIN_CONNECTIONS
    return max(MIN_CONNECTIONS, max_num_seqs * max(1, senders_per_request))


class Slots:
    """A count of connections served at once: looked at when a hello comes, taken once it is
    authenticated, released when its exchange ends."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a side channel needs at least one connection slot")
        self._free = size
        self._changed = threading.Condition()

    @property
    def free(self) -> int:
        with self._changed:
            return self._free

    def take(self, timeout: float) -> bool:
        """One slot, waiting up to `timeout` seconds for one to be released; False if none came."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._free == 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            self._free -= 1
            return True

    def release(self) -> None:
        with self._changed:
            self._free += 1
            self._changed.notify()
