"""Leader election on a coordination.k8s.io Lease: with two operator replicas, at most one reconciles.

The guards are client-go's:
- Leadership is local and expires by itself: a holder counts as leader only while its last successful
  renew is younger than `renew_deadline_seconds` (a monotonic clock), shorter than the lease, so a
  holder whose renewals hang stops acting before anyone else may take over.
- Expiry is decided by local observation, never by comparing another machine's clock: a lease held by
  someone else is taken only after it has not changed (its resourceVersion) for `lease_seconds` of
  this process's own time.
- Every attempt has its own timeout, and any exception counts as a failed attempt; the loop never dies.
Updates carry the Lease's resourceVersion, so two candidates cannot both win one write.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dllm_operator import metrics
from dllm_operator.kube import ApiError, KubeClient

log = logging.getLogger(__name__)


def _micro_time(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaseObservation:
    """When this process last saw the lease change; the only clock expiry is judged by."""

    version: str = ""
    seen_at: float = 0.0

    def update(self, lease: dict[str, Any], now: float) -> None:
        version = str(lease.get("metadata", {}).get("resourceVersion", ""))
        if version != self.version:
            self.version, self.seen_at = version, now

    def expired(self, lease: dict[str, Any], now: float) -> bool:
        duration = int(lease.get("spec", {}).get("leaseDurationSeconds") or 15)
        return now - self.seen_at > duration


@dataclass
class LeaderElector:
    client: KubeClient
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    renew_seconds: float = 2.0
    on_elected: Callable[[], None] = lambda: None
    clock: Callable[[], float] = time.monotonic
    _renewed_at: float | None = field(default=None, init=False)
    _published: bool = field(default=False, init=False)
    _observed: LeaseObservation = field(default_factory=LeaseObservation, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.renew_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError("leader election needs renew period < renew deadline < lease duration")

    def is_leader(self) -> bool:
        renewed = self._renewed_at
        return renewed is not None and self.clock() - renewed < self.renew_deadline_seconds

    def _lease_body(self, existing: dict[str, Any] | None, now: dt.datetime) -> dict[str, Any]:
        spec = dict((existing or {}).get("spec", {}))
        taking_over = spec.get("holderIdentity") != self.identity
        spec.update(
            {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.lease_seconds,
                "renewTime": _micro_time(now),
            }
        )
        if taking_over:
            spec["acquireTime"] = _micro_time(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions", 0)) + (1 if existing else 0)
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if existing:
            metadata["resourceVersion"] = existing["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}

    async def try_acquire_or_renew(self) -> bool:
        lease = await self.client.get_lease(self.namespace, self.name)
        started = self.clock()
        if lease is not None:
            self._observed.update(lease, started)
            holder = lease.get("spec", {}).get("holderIdentity")
            if holder and holder != self.identity and not self._observed.expired(lease, started):
                return False
        wall = dt.datetime.now(dt.UTC)  # written for humans and other tools; never compared here
        try:
            if lease is None:
                written = await self.client.create_lease(self._lease_body(None, wall))
            else:
                written = await self.client.replace_lease(self._lease_body(lease, wall))
        except ApiError as error:
            if error.status in (409, 422):  # someone else won the race
                return False
            raise
        self._observed.update(written, started)
        self._renewed_at = started  # the deadline counts from before the write was sent
        return True

    async def attempt(self) -> None:
        """One acquire-or-renew, bounded in time; any failure is logged and leaves the deadline running."""
        try:
            won = await asyncio.wait_for(self.try_acquire_or_renew(), self.renew_deadline_seconds)
        except Exception as error:  # noqa: BLE001 (network, decode, API: all mean "not renewed this time")
            log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(error).__name__, error)
        else:
            if not won:
                self._renewed_at = None  # someone else holds it: stop at once
        self._publish()

    def _publish(self) -> None:
        leader = self.is_leader()
        if leader == self._published:
            return
        log.info("%s leadership of %s/%s", "acquired" if leader else "lost", self.namespace, self.name)
        self._published = leader
        metrics.LEADER.set(1 if leader else 0)
        if leader:
            self.on_elected()

    async def release(self) -> None:
        """On a clean shutdown, hand the lease over at once instead of after its expiry."""
        if not self.is_leader():
            return
        self._renewed_at = None
        self._publish()
        lease = await self.client.get_lease(self.namespace, self.name)
        if lease is None or lease.get("spec", {}).get("holderIdentity") != self.identity:
            return
        lease["spec"] |= {"holderIdentity": "", "leaseDurationSeconds": 1}
        await self.client.replace_lease(lease)

    async def run(self) -> None:
        while True:
            await self.attempt()
            await asyncio.sleep(self.renew_seconds)
            self._publish()  # a deadline that passed while a call hung shows at once
