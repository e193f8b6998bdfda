"""Decode's expectations: the loads it waits for, the prefill parts that claim them, and their outcomes.

An expectation ends exactly once (loaded, failed, timed out or cancelled), and only once no part
writes into its blocks any more (H5). Thread-safe; the engine step calls `results`.

Waiters wake only for their own id (H4): an offer waiting for decode to expect its id, and a caller
waiting for an id's outcome, each wait on a condition of that id, notified when that id is expected,
ended or settled. Expiry is off the hot path: deadlines sit in a heap, and each `results` or `add`
expires at most `EXPIRY_PER_CALL` of the due ones; a waiter for an id expires that one itself.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from dllm_connector.layout import HeadRange
from dllm_connector.pipe.common import POLL_S, PipeStats, TransferFailed
from dllm_connector.pipe.records import TransferRecords
from dllm_connector.transport.base import TransferTimeout

# Ended transfers remembered, so a late part's offer is refused at once, not held.
_ENDED_KEPT = 1000
# Due deadlines one `results` or `add` call handles at most (the rest wait for the next call).
EXPIRY_PER_CALL = 64


@dataclass
class Expectation:
    """A load decode waits for: from each prefill rank in `senders`, the model heads it sends.

    It ends once, when every sender's part is loaded, or when one failed (or none came in time) and
    no part is still being written.
    """

    transfer_id: str
    block_ids: tuple[int, ...]
    skip: int
    prompt_hash: str
    deadline: float
    prefill_tp: int = 1
    senders: dict[int, HeadRange | None] = field(default_factory=lambda: {0: None})
    claimed: set[int] = field(default_factory=set)  # prefill ranks whose offer was accepted
    active: set[int] = field(default_factory=set)  # claimed and not ended yet
    loaded: set[int] = field(default_factory=set)
    failure: str = ""
    timed_out: bool = False

    @property
    def waiting(self) -> bool:
        """Some sender has not offered yet (the prefill wait applies)."""
        return not self.failure and len(self.claimed) < len(self.senders)


@dataclass(eq=False)
class Part:
    """One prefill rank's share of an expectation, claimed by its offer."""

    expectation: Expectation
    prefill_rank: int
    heads: HeadRange | None  # this rank's heads that arrive; None: all of them
    told_to_stop: bool = False  # decode nacked mid-stream; the sender's done or abort is awaited


@dataclass(eq=False)
class _Watch:
    """The condition the waiters for one id wait on (on the registry's lock), and how many wait."""

    changed: threading.Condition
    waiters: int = 0


class Expectations:
    """The expectations of one receiver, keyed by transfer id, and the outcomes not yet collected."""

    def __init__(
        self, stats: PipeStats, prefill_wait_s: float, records: TransferRecords | None = None
    ) -> None:
        self._stats = stats
        self._records = records
        self._prefill_wait_s = prefill_wait_s
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # close() waits on it for parts to end
        self._expected: dict[str, Expectation] = {}
        self._results: dict[str, str] = {}  # transfer id -> "" loaded, else reason
        self._ended: dict[str, None] = {}  # the latest _ENDED_KEPT ids that ended
        self._refused: dict[str, str] = {}  # ids whose offer was refused before they were expected
        self._watches: dict[str, _Watch] = {}
        self._deadlines: list[tuple[float, int, Expectation]] = []  # a heap; stale entries skipped
        self._order = itertools.count()
        self.wakeups = 0  # times a waiter woke (for tests: only the waiters of a changed id wake)
        self._claims_waiting = 0

    @property
    def pending(self) -> set[str]:
        with self._lock:
            return set(self._expected)

    @property
    def claims_waiting(self) -> int:
        """Offers waiting in `claim` for decode to expect their id."""
        with self._lock:
            return self._claims_waiting

    def add(
        self,
        transfer_id: str,
        block_ids: tuple[int, ...],
        skip: int,
        prompt_hash: str,
        prefill_tp: int,
        senders: dict[int, HeadRange | None],
    ) -> None:
        deadline = time.monotonic() + self._prefill_wait_s
        with self._lock:
            if transfer_id in self._expected or transfer_id in self._results:
                raise TransferFailed(f"transfer {transfer_id} is already expected")
            expectation = Expectation(
                transfer_id, block_ids, skip, prompt_hash, deadline, prefill_tp, senders
            )
            self._expected[transfer_id] = expectation
            heapq.heappush(self._deadlines, (deadline, next(self._order), expectation))
            self._ended.pop(transfer_id, None)
            self._notify_locked(transfer_id)
            self._expire_due_locked()  # the heap stays bounded where `results` is never called
            refused = self._refused.pop(transfer_id, None)
            if refused is not None:  # its offer came first and was refused: prefill sends nothing more
                expectation.failure = refused
                self._settle_locked(expectation)

    def cancel(self, transfer_id: str) -> None:
        """The expectation fails, and ends once no part writes into its blocks any more (H5)."""
        with self._lock:
            expectation = self._expected.get(transfer_id)
            if expectation is None:
                return
            if not expectation.failure:
                expectation.failure = "cancelled by decode"
            self._settle_locked(expectation)

    def results(self) -> dict[str, str]:
        """Expectations that ended since the last call: id -> "" when loaded, else the failure reason."""
        with self._lock:
            self._expire_due_locked()
            done, self._results = self._results, {}
        return done

    def wait_for(self, transfer_id: str, timeout: float) -> str | None:
        """Block until this transfer ends (its outcome, consumed) or timeout (None)."""
        with self._lock:
            if self._wait_settled_locked(transfer_id, time.monotonic() + timeout):
                return self._results.pop(transfer_id)
            return None

    def wait_settled(self, transfer_id: str, timeout: float) -> bool:
        """Block until this transfer has ended, without consuming its outcome."""
        with self._lock:
            return self._wait_settled_locked(transfer_id, time.monotonic() + timeout)

    def _wait_settled_locked(self, transfer_id: str, deadline: float) -> bool:
        with self._watching(transfer_id) as changed:
            while True:
                expectation = self._expected.get(transfer_id)
                if expectation is not None:
                    self._expire_if_due_locked(expectation)
                if transfer_id in self._results:
                    return True
                now = time.monotonic()
                if now >= deadline:
                    return False
                wake = deadline
                if expectation is not None and expectation.waiting:
                    wake = min(wake, expectation.deadline)
                changed.wait(max(0.001, wake - now))
                self.wakeups += 1

    @contextlib.contextmanager
    def _watching(self, transfer_id: str) -> Iterator[threading.Condition]:
        """The condition notified when `transfer_id` changes (call with the lock held)."""
        watch = self._watches.get(transfer_id)
        if watch is None:
            watch = self._watches[transfer_id] = _Watch(threading.Condition(self._lock))
        watch.waiters += 1
        try:
            yield watch.changed
        finally:
            watch.waiters -= 1
            if not watch.waiters:
                del self._watches[transfer_id]

    def _notify_locked(self, transfer_id: str) -> None:
        watch = self._watches.get(transfer_id)
        if watch is not None:
            watch.changed.notify_all()

    def _expire_due_locked(self) -> None:
        """Expire at most EXPIRY_PER_CALL of the expectations whose prefill wait is over."""
        now = time.monotonic()
        for _ in range(EXPIRY_PER_CALL):
            if not self._deadlines or self._deadlines[0][0] > now:
                return
            _, _, expectation = heapq.heappop(self._deadlines)
            self._expire_if_due_locked(expectation, now)

    def _expire_if_due_locked(self, expectation: Expectation, now: float | None = None) -> None:
        """End `expectation` if some sender has not offered by its deadline (a stale one: nothing)."""
        if self._expected.get(expectation.transfer_id) is not expectation or not expectation.waiting:
            return
        if (time.monotonic() if now is None else now) < expectation.deadline:
            return
        expectation.failure = self._nothing_sent(expectation)
        expectation.timed_out = True
        self._settle_locked(expectation)

    def _nothing_sent(self, expectation: Expectation) -> str:
        wait = f"{self._prefill_wait_s:.1f}s"
        if len(expectation.senders) == 1 and not expectation.claimed:
            return f"prefill sent nothing within {wait}"
        missing = sorted(set(expectation.senders) - expectation.claimed)
        return f"prefill TP ranks {missing} of {expectation.prefill_tp} sent nothing within {wait}"

    def end(self, transfer_id: str, part: Part | None, reason: str, *, timed_out: bool = False) -> None:
        """A part ended (or an offer failed before claiming one): settle its expectation."""
        with self._lock:
            expectation = self._expected.get(transfer_id)
            if expectation is None and part is None and reason:
                self._remember_refused_locked(transfer_id, reason)  # its expectation fails as it comes
            if expectation is None or (part is not None and part.expectation is not expectation):
                return
            if part is not None:
                expectation.active.discard(part.prefill_rank)
                if not reason:
                    expectation.loaded.add(part.prefill_rank)
            if reason and not expectation.failure:
                expectation.failure, expectation.timed_out = reason, timed_out
            self._settle_locked(expectation)

    def _settle_locked(self, expectation: Expectation) -> None:
        """End the expectation once nothing writes into its blocks any more and the outcome is known."""
        if expectation.active:
            return
        if expectation.failure:
            self._finish_locked(expectation.transfer_id, expectation.failure, timed_out=expectation.timed_out)
        elif expectation.loaded == set(expectation.senders):
            self._finish_locked(expectation.transfer_id, "")

    def _finish_locked(self, transfer_id: str, reason: str, *, timed_out: bool = False) -> None:
        expectation = self._expected.pop(transfer_id, None)
        if expectation is None:
            return
        expectation.failure = expectation.failure or reason  # parts still streaming stop loading
        self._results[transfer_id] = reason
        self._remember_ended_locked(transfer_id)
        if self._records is not None:
            self._records.end(transfer_id, reason)
        if reason:
            self._stats.failed_receives += 1
            self._stats.timeouts += timed_out
        else:
            self._stats.received += 1
        self._notify_locked(transfer_id)
        self._settled.notify_all()

    def _remember_refused_locked(self, transfer_id: str, reason: str) -> None:
        """An offer refused before decode expected its id (a layout that differs, say): kept, bounded,
        so the expectation fails with that reason when it comes instead of waiting for prefill."""
        _remember(self._refused, transfer_id, reason)

    def _remember_ended_locked(self, transfer_id: str) -> None:
        _remember(self._ended, transfer_id, None)

    def end_id(self, transfer_id: str) -> None:
        """Decode will never expect this id: a waiting or later offer for it is refused at once."""
        with self._lock:
            if transfer_id in self._expected:
                return  # decode's own expectation wins over a peer's word
            self._remember_ended_locked(transfer_id)
            self._notify_locked(transfer_id)

    def claim(self, transfer_id: str, hold_s: float, check: Callable[[Expectation], Part]) -> Part:
        """Wait (up to `hold_s`) until decode expects this id, then own the part `check` names."""
        deadline = time.monotonic() + hold_s
        with self._lock, self._watching(transfer_id) as changed:
            while True:
                expectation = self._expected.get(transfer_id)
                if expectation is not None:
                    self._expire_if_due_locked(expectation)
                if expectation is not None and self._expected.get(transfer_id) is expectation:
                    part = check(expectation)
                    expectation.claimed.add(part.prefill_rank)
                    expectation.active.add(part.prefill_rank)
                    return part
                if transfer_id in self._results or transfer_id in self._ended:
                    raise TransferFailed(f"transfer {transfer_id} is not awaited any more")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"decode did not claim transfer {transfer_id} within {hold_s:.1f}s")
                self._claims_waiting += 1
                try:
                    changed.wait(left)
                finally:
                    self._claims_waiting -= 1
                self.wakeups += 1

    def close(self, reason: str, timeout: float) -> list[str]:
        """Fail every expectation and end each once no part is active, waiting up to `timeout`; the
        ids still written into then (ended anyway: the caller keeps their memory registered)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            for expectation in list(self._expected.values()):
                expectation.failure = expectation.failure or reason
                self._settle_locked(expectation)
            while (active := {e.transfer_id for e in self._expected.values() if e.active}) and (
                left := deadline - time.monotonic()
            ) > 0:
                self._settled.wait(min(left, POLL_S * 10))
            for transfer_id in list(self._expected):
                self._finish_locked(transfer_id, reason)
        return sorted(active)


_V = TypeVar("_V")


def _remember(kept: dict[str, _V], transfer_id: str, value: _V) -> None:
    """Keep `value` for the id, forgetting the oldest past _ENDED_KEPT ids."""
    kept[transfer_id] = value
    while len(kept) > _ENDED_KEPT:
        del kept[next(iter(kept))]
