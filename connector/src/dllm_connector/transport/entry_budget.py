"""How many transfer entries one Mooncake engine may have in flight at once, shared by every thread
writing through it.

Mooncake 0.3.14's engine fails every batch once more than 2048 entries are in flight from it, whichever
calls they came from (its TCP transport here; measured: three threads writing 1024 entries each fail
together, two do not, and a single call of 2049 fails): a prefill engine serving a few transfers at
once, each a long zero-copy batch of block spans, crossed that and failed all of them. Each call waits
for room instead (docs/kv-connector.md, Transports).
"""

from __future__ import annotations

import threading
import time

MOONCAKE_ENTRIES_IN_FLIGHT = 2048


class EntryBudget:
    def __init__(self, capacity: int = MOONCAKE_ENTRIES_IN_FLIGHT) -> None:
        self.capacity = capacity
        self._free = capacity
        self._room = threading.Condition()

    @property
    def in_use(self) -> int:
        with self._room:
            return self.capacity - self._free

    def acquire(self, entries: int, deadline: float) -> bool:
        """Take `entries` (at most the capacity) once they are free; False if not by `deadline`
        (monotonic)."""
        if not 0 < entries <= self.capacity:
            raise ValueError(f"{entries} entries: a call takes 1..{self.capacity}")
        with self._room:
            while self._free < entries:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._room.wait(left)
            self._free -= entries
            return True

    def release(self, entries: int) -> None:
        with self._room:
            self._free = min(self.capacity, self._free + entries)
            self._room.notify_all()
