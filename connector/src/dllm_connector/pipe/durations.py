"""How long each transfer took (and waited), kept until the connector's next stats report takes them;
and the seconds spent in the codec, summed.

vLLM asks every worker for its stats once per engine step, so between two reports only a few
transfers end; the cap only matters if nobody asks (an idle engine whose stats are never read),
where the oldest are dropped rather than kept without bound.
"""

from __future__ import annotations

import threading
from collections import deque

# More transfers than one step can end even with vLLM's largest batches.
KEPT = 4096


class Durations:
    """Seconds per finished transfer, appended by the transfer threads, taken by the stats reader."""

    def __init__(self, kept: int = KEPT) -> None:
        self._lock = threading.Lock()
        self._seconds: deque[float] = deque(maxlen=kept)

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds.append(seconds)

    def take(self) -> list[float]:
        with self._lock:
            taken = list(self._seconds)
            self._seconds.clear()
        return taken


class SecondsTotal:
    """Seconds summed across threads (the codec's time in every transfer of one side)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._total += seconds

    @property
    def total(self) -> float:
        with self._lock:
            return self._total
