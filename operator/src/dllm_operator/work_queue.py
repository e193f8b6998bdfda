"""The keys to reconcile: each CR at most once queued and once in flight, with back-off after failures."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from dllm_operator.store import CRKey


class WorkQueue:
    """Keys to reconcile; each at most once in the queue and once in flight."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[CRKey] = asyncio.Queue()
        self._queued: set[CRKey] = set()
        self._active: set[CRKey] = set()
        self._dirty: set[CRKey] = set()
        self._failures: dict[CRKey, int] = defaultdict(int)

    def add(self, key: CRKey) -> None:
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: CRKey, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self.add, key)

    async def get(self) -> CRKey:
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: CRKey, failed: bool) -> float | None:
        """Finish a key; returns the retry delay after a failure."""
        self._active.discard(key)
        delay = None
        if failed:
            self._failures[key] += 1
            delay = min(0.5 * 2 ** (self._failures[key] - 1), 60.0)
        else:
            self._failures.pop(key, None)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)
        return delay

    def __len__(self) -> int:
        return len(self._queued) + len(self._active)
