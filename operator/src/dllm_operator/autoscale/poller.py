"""The autoscaler's loop (issue 36): every poll, for each resource the operator is asked about, read
its engine and router pods' metrics pages (scrape.py), turn two scrapes into each role's signal
(signals.py), decide (decide.py), hand every decision to `acted` (active mode's steps), and hand the
result on when it is worth a status write (status.py): a changed recommendation at once, fresh values
once a minute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from dllm_operator.api.autoscaling import AutoscalingSpec
from dllm_operator.autoscale.decide import Decision, Role, Signal, decide
from dllm_operator.autoscale.scrape import ScrapeMemory, read_metrics
from dllm_operator.autoscale.signals import signals_for
from dllm_operator.autoscale.status import recommended, status_of, worth_writing
from dllm_operator.page_reads import poll_forever

READ_TIMEOUT_S = 3.0
PARALLEL_READS = 8
Pod = tuple[str, str, int]  # name, IP, HTTP port


@dataclass(frozen=True)
class Target:
    """What one resource's autoscaling reads: its spec, its ready pods by role (prefill, decode,
    router), and the replicas each engine role runs now."""

    spec: AutoscalingSpec
    pods: Mapping[str, list[Pod]]
    current: Mapping[Role, int]


@dataclass
class _Kept:
    history: Mapping[Role, tuple[tuple[float, int], ...]]
    status: dict[str, Any] | None = None
    written_at: float = 0.0
    # Each role's latest signal: a failed read leaves it standing until it is too old (decide.py
    # judges its age against signalMaxAgeSeconds), so one lost page does not flip a recommendation.
    signals: dict[Role, Signal] = field(default_factory=dict)


class AutoscalePoller:
    """`targets()` names the resources to read; `acted(key, decision)` gets every decision;
    `decided(key, status, changed)` gets status.autoscaling when it is worth writing, `changed` when a
    recommended count moved (an Event's worth)."""

    def __init__(
        self,
        interval_s: float,
        targets: Callable[[], Mapping[Any, Target]],
        decided: Callable[[Any, dict[str, Any], bool], None],
        clock: Callable[[], float] = time.time,
        acted: Callable[[Any, Decision], None] | None = None,
    ) -> None:
        self._interval_s, self._targets, self._decided, self._clock = interval_s, targets, decided, clock
        self._acted = acted
        self._memory = ScrapeMemory()
        self._kept: dict[Any, _Kept] = {}

    async def run(self) -> None:
        await poll_forever(self._interval_s, self.poll, READ_TIMEOUT_S, PARALLEL_READS)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        targets = self._targets()
        self._kept = {key: kept for key, kept in self._kept.items() if key in targets}
        self._memory.forget({(key, role) for key, target in targets.items() for role in target.pods})
        for key, target in targets.items():
            scraped = {
                role: await self._read(session, pods) for role, pods in target.pods.items()
            }  # one resource at a time; its pods side by side
            now = self._clock()
            pairs = {role: self._memory.pair((key, role), pages) for role, pages in scraped.items()}
            signals = signals_for(
                target.spec, pairs.get("prefill", []), pairs.get("decode", []), pairs.get("router", []), now
            )
            kept = self._kept.setdefault(key, _Kept({}))
            kept.signals.update({role: signal for role, signal in signals.items() if signal is not None})
            latest = {role: kept.signals.get(role) for role in signals}
            decision = decide(target.spec, target.current, latest, kept.history, now)
            kept.history = decision.history
            if self._acted is not None:
                self._acted(key, decision)
            if worth_writing(kept.status, decision, kept.written_at, now):
                status = status_of(decision, now)
                changed = recommended(kept.status) != recommended(status)
                kept.status, kept.written_at = status, now
                self._decided(key, kept.status, changed)

    @staticmethod
    async def _read(session: aiohttp.ClientSession, pods: list[Pod]) -> dict[str, Any]:
        pages = await asyncio.gather(*(read_metrics(session, ip, port) for _, ip, port in pods))
        return {name: page for (name, _, _), page in zip(pods, pages, strict=True)}
