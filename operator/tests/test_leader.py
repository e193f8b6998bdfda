"""Leader election under faults (review H8): the loop survives any error, leadership lapses by a local
deadline while a renewal hangs, and another machine's clock never decides expiry.

The Lease API here is `LeaseApiDouble`, an in-memory double with resourceVersion semantics: the faults
(a disconnect mid-call, a renewal that hangs) cannot be produced on demand by the real API server. The
real one is used by test_k8s_operator.py's two-replica handover test.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any, cast

import aiohttp
import pytest

from dllm_operator.kube import ApiError, KubeClient
from dllm_operator.leader import LeaderElector
from dllm_operator.runner import _stop_when_done


class LeaseApiDouble:
    """Double of the Lease calls of KubeClient, with optimistic concurrency on resourceVersion."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.get_fault: BaseException | None = None
        self.replace_gate: asyncio.Event | None = None  # set: a replace waits until the gate opens

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.get_fault is not None:
            raise self.get_fault
        return copy.deepcopy(self.lease)

    async def create_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", "lease exists")
        return self._store(lease)

    async def replace_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        if self.replace_gate is not None:
            await self.replace_gate.wait()
        assert self.lease is not None
        if lease["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        return self._store(lease)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(lease)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    def backdate(self, renew_time: str) -> None:
        """Another machine's clock: the holder writes renewTimes far in the past."""
        assert self.lease is not None
        self.lease["spec"]["renewTime"] = renew_time


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(api: LeaseApiDouble, identity: str, clock: FakeClock) -> LeaderElector:
    return LeaderElector(cast(KubeClient, api), "ns", "lease", identity, clock=clock)


async def test_the_loop_survives_errors_that_are_not_os_errors_and_leadership_lapses() -> None:
    api, clock = LeaseApiDouble(), FakeClock()
    one = elector(api, "one", clock)
    await one.attempt()
    assert one.is_leader()
    for fault in (
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientPayloadError("truncated"),
        json.JSONDecodeError("not JSON", "<html>", 0),
    ):
        api.get_fault = fault
        clock.now += 4
        await one.attempt()  # does not raise
    assert not one.is_leader(), "12 s without a renewal is past the 10 s renew deadline"
    api.get_fault = None
    await one.attempt()
    assert one.is_leader(), "the loop recovered and renewed"


async def test_a_hanging_renewal_ends_leadership_by_the_deadline() -> None:
    api, clock = LeaseApiDouble(), FakeClock()
    one = elector(api, "one", clock)
    await one.attempt()
    api.replace_gate = asyncio.Event()
    pending = asyncio.create_task(one.attempt())
    await asyncio.sleep(0)  # the renewal is now waiting on the gate
    clock.now += 9.9
    assert one.is_leader()
    clock.now += 0.2
    assert not one.is_leader(), "past the deadline while the renewal still hangs"
    api.replace_gate.set()
    await pending


async def test_expiry_is_judged_by_local_observation_not_by_the_holders_clock() -> None:
    api, clock = LeaseApiDouble(), FakeClock()
    holder, other = elector(api, "holder", clock), elector(api, "other", clock)
    await holder.attempt()
    for _ in range(10):  # 40 s of renewals stamped by a clock 30 s behind
        api.backdate("2020-01-01T00:00:00.000000Z")
        await other.attempt()
        assert not other.is_leader()
        clock.now += 4
        await holder.attempt()
        assert holder.is_leader()
    stopped = clock.now  # the holder stops renewing; the other polls every 2 s
    while not other.is_leader():
        await other.attempt()
        assert clock.now - stopped <= 18, "the lease is taken within one poll after 15 s unchanged"
        clock.now += 2
    assert clock.now - stopped > 15, "never before the lease was unchanged for 15 s"
    await holder.attempt()
    assert not holder.is_leader(), "the old holder sees another holder and stops at once"


async def test_release_hands_over_at_once() -> None:
    api, clock = LeaseApiDouble(), FakeClock()
    one, two = elector(api, "one", clock), elector(api, "two", clock)
    await one.attempt()
    await two.attempt()
    assert not two.is_leader()
    await one.release()
    assert not one.is_leader()
    await two.attempt()
    assert two.is_leader()


def test_periods_must_nest() -> None:
    with pytest.raises(ValueError, match="renew period < renew deadline < lease duration"):
        LeaderElector(cast(KubeClient, LeaseApiDouble()), "ns", "lease", "x", renew_deadline_seconds=20)


async def test_a_dead_leader_loop_stops_the_operator() -> None:
    stop, ended = asyncio.Event(), list[str]()

    async def dies() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(dies(), name="leader")
    task.add_done_callback(lambda done: _stop_when_done(stop, ended, done))
    await asyncio.wait_for(stop.wait(), 5)
    assert ended == ["leader stopped: RuntimeError('boom')"]
