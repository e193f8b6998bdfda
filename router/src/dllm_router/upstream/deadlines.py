"""One timer for the time limits of many calls."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dllm_router.upstream.call import Call


class Deadlines:
    """The time limit of many calls, kept with one timer instead of one per call (starting and
    cancelling a uvloop timer costs a few microseconds, twice per request). Every call here has the
    same limit, so deadlines come in the order calls start: the calls wait in a FIFO, and the timer is
    set for the oldest. When it fires, the calls past their deadline time out, finished ones are
    dropped, and it is set again for the oldest left. Finished calls are also swept out whenever they
    outnumber the unfinished ones, so a long call at the head does not make the FIFO grow."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._calls: deque[Call] = deque()
        self._open = 0  # unfinished calls in _calls
        self._timer: asyncio.TimerHandle | None = None

    def add(self, call: Call, loop: asyncio.AbstractEventLoop) -> float:
        """Track `call`; returns its deadline (on the loop's clock)."""
        deadline = loop.time() + self.limit_s
        call.deadline = deadline
        calls = self._calls
        calls.append(call)
        self._open += 1
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire_due)
        elif len(calls) > 2 * self._open + 64:
            self._calls = deque(c for c in calls if c.open)
        return deadline

    def finished(self) -> None:
        self._open -= 1

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def tracked(self) -> int:
        """Calls held (unfinished ones, and finished ones not yet swept out)."""
        return len(self._calls)

    def _expire_due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._calls:  # self._calls, not a local: expiring a call may add (and sweep) calls
            call = self._calls[0]
            if call.open and call.deadline > now:
                self._timer = loop.call_at(call.deadline, self._expire_due)
                return
            self._calls.popleft()
            if call.open:
                call.expire()
