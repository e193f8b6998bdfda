"""Leader election on a coordination.k8s.io Lease: with two operator replicas, exactly one reconciles.

The holder renews every `renew_seconds`; another replica takes the lease once it has not been renewed
for `lease_seconds`. Updates use the Lease's resourceVersion, so two candidates cannot both win.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dllm_operator import metrics
from dllm_operator.kube import ApiError, KubeClient

log = logging.getLogger("dllm_operator.leader")


def _micro_time(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    return dt.datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")


def lease_expired(lease: dict[str, Any], now: dt.datetime) -> bool:
    spec = lease.get("spec", {})
    renewed = _parse_time(spec.get("renewTime"))
    duration = int(spec.get("leaseDurationSeconds", 15))
    return renewed is None or now - renewed > dt.timedelta(seconds=duration)


@dataclass
class LeaderElector:
    client: KubeClient
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 15
    renew_seconds: float = 5.0
    on_elected: Callable[[], None] = lambda: None
    _leader: bool = field(default=False, init=False)

    def is_leader(self) -> bool:
        return self._leader

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
        now = dt.datetime.now(dt.UTC)
        lease = await self.client.get_lease(self.namespace, self.name)
        holder = (lease or {}).get("spec", {}).get("holderIdentity")
        if lease is not None and holder and holder != self.identity and not lease_expired(lease, now):
            return False
        try:
            if lease is None:
                await self.client.create_lease(self._lease_body(None, now))
            else:
                await self.client.replace_lease(self._lease_body(lease, now))
        except ApiError as error:
            if error.status in (409, 422):  # someone else won the race
                return False
            raise
        return True

    async def release(self) -> None:
        """On a clean shutdown, hand the lease over at once instead of after its expiry."""
        if not self._leader:
            return
        self._leader = False
        metrics.LEADER.set(0)
        lease = await self.client.get_lease(self.namespace, self.name)
        if lease is None or lease.get("spec", {}).get("holderIdentity") != self.identity:
            return
        lease["spec"] |= {"holderIdentity": "", "leaseDurationSeconds": 1}
        await self.client.replace_lease(lease)

    async def run(self) -> None:
        while True:
            try:
                leader = await self.try_acquire_or_renew()
            except (TimeoutError, ApiError, OSError) as error:
                log.warning("lease %s/%s: %s", self.namespace, self.name, error)
                leader = False
            if leader != self._leader:
                log.info(
                    "%s leadership of %s/%s", "acquired" if leader else "lost", self.namespace, self.name
                )
                self._leader = leader
                metrics.LEADER.set(1 if leader else 0)
                if leader:
                    self.on_elected()
            await asyncio.sleep(self.renew_seconds)
