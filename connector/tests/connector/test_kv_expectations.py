"""Decode's expectations wake only the waiters of the id that changed, and still expire on time (H4).

The real Expectations registry with real threads; no doubles. Bounds on time are generous: the
asserts are on what woke and what was done, not on how fast.
"""

from __future__ import annotations

import threading
import time

import pytest

from dllm_connector.pipe.common import PipeStats, TransferFailed
from dllm_connector.pipe.expectations import EXPIRY_PER_CALL, Expectation, Expectations, Part

pytestmark = pytest.mark.timeout(120)

WAITERS = 200
HOLD = 60.0  # far longer than any test runs: a waiter ends because of what happened, not by its hold


def whole(expectation: Expectation) -> Part:
    return Part(expectation, 0, None)


def add(expectations: Expectations, transfer_id: str) -> None:
    expectations.add(transfer_id, (1, 2), 0, "", 1, {0: None})


def test_offers_waiting_for_unknown_ids_are_not_woken_by_a_real_transfer() -> None:
    expectations = Expectations(PipeStats(), prefill_wait_s=HOLD)
    outcomes: dict[str, str] = {}
    waiting = threading.Semaphore(0)

    def wait_for_unknown(transfer_id: str) -> None:
        waiting.release()
        try:
            expectations.claim(transfer_id, HOLD, whole)
            outcomes[transfer_id] = "claimed"
        except TransferFailed as error:
            outcomes[transfer_id] = str(error)

    threads = [threading.Thread(target=wait_for_unknown, args=(f"unknown-{i}",)) for i in range(WAITERS)]
    for thread in threads:
        thread.start()
    for _ in range(WAITERS):
        assert waiting.acquire(timeout=30)
    claimed: list[Part] = []
    real = threading.Thread(target=lambda: claimed.append(expectations.claim("real", HOLD, whole)))
    real.start()
    add(expectations, "real")  # the real transfer: expected, claimed, loaded, collected
    real.join(30)
    assert claimed
    expectations.end("real", claimed[0], "")
    assert expectations.wait_for("real", 30) == ""
    assert expectations.results() == {}
    assert expectations.wakeups <= 1  # the real claimer at most (it may have found its id at once)
    assert not outcomes  # no unknown-id waiter woke, or ended

    for i in range(WAITERS):  # each unknown id ended: exactly its waiter wakes, once
        expectations.end_id(f"unknown-{i}")
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == WAITERS
    assert all("not awaited any more" in outcome for outcome in outcomes.values())
    assert expectations.wakeups <= 1 + WAITERS


def test_an_expectation_expires_on_time_for_its_waiter() -> None:
    wait = 0.3
    expectations = Expectations(PipeStats(), prefill_wait_s=wait)
    started = time.monotonic()  # before add(), where the wait's deadline is set
    add(expectations, "late")
    assert expectations.wait_for("late", 30) == f"prefill sent nothing within {wait:.1f}s"
    took = time.monotonic() - started
    assert wait <= took < 10  # woke for its own deadline, not at the end of the 30 s
    assert expectations.pending == set()


def test_an_offer_after_the_prefill_wait_is_refused() -> None:
    expectations = Expectations(PipeStats(), prefill_wait_s=0.1)
    add(expectations, "due")
    assert expectations.wait_settled("due", 30)
    with pytest.raises(TransferFailed, match="not awaited any more"):
        expectations.claim("due", HOLD, whole)


def test_expiry_in_the_engine_step_is_bounded_per_call_and_reaches_every_expectation() -> None:
    count = 3 * EXPIRY_PER_CALL
    stats = PipeStats()
    expectations = Expectations(stats, prefill_wait_s=1.0)
    for i in range(count):
        add(expectations, f"t-{i}")
    last = f"t-{count - 1}"
    assert expectations.wait_settled(last, 30)  # its waiter expired it alone; the others are due too
    assert len(expectations.pending) == count - 1
    ended: dict[str, str] = {}
    calls = 0
    while len(ended) < count:
        collected = expectations.results()
        assert len(collected) <= EXPIRY_PER_CALL + 1  # the bound (plus what had ended before)
        ended |= collected
        calls += 1
        assert calls <= count
    assert calls >= 3
    assert set(ended.values()) == {"prefill sent nothing within 1.0s"}
    assert stats.timeouts == count
    assert expectations.pending == set()
