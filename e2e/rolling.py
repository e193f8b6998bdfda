"""A spec change rolled out on the served sample while a client keeps sending requests, and what each
request was told: shared by the node tier's rolling test and `python -m e2e.roll_soak`, which repeats it."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

from e2e.fixtures import wait_until
from e2e.served_sample import NAME, NAMESPACE, PROMPTS, Served, completion

# A 503 naming the role with no ready pod: refused up front, never accepted by an engine.
REFUSED = frozenset({"no_prefill", "no_decode"})


@dataclass(frozen=True)
class Outcome:
    request_id: str
    status: int  # 0: the router itself could not be reached
    kind: str  # the error's type, "" for a 200
    message: str

    @property
    def refused(self) -> bool:
        return self.status == 503 and self.kind in REFUSED

    @property
    def accepted_and_failed(self) -> bool:
        return self.status != 200 and not self.refused


@dataclass
class Trickle:
    """One request after another through the router, each with its own X-Request-Id (so a failure can
    be found in both engines' logs), until stopped."""

    served: Served
    prefix: str
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        deadline = time.monotonic() + 1800
        while not self._stop.is_set() and time.monotonic() < deadline:
            rid = f"{self.prefix}-{len(self.outcomes)}"
            try:
                # Long enough for a restarted engine's first request on two busy cores.
                status, body = completion(self.served.router, PROMPTS[1], timeout=600, request_id=rid)
                problem = body.get("error", {}) if isinstance(body.get("error"), dict) else {}
                message = "" if status == 200 else str(problem.get("message", body))[:300]
                self.outcomes.append(Outcome(rid, status, str(problem.get("type", "")), message))
            except OSError as error:  # counted as a failure: the router itself must stay reachable
                self.outcomes.append(Outcome(rid, 0, type(error).__name__, repr(error)[:300]))
            self._stop.wait(0.2)  # a client's think time, not a wait on a condition

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=f"trickle-{self.prefix}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=660)


def rolled(served: Served, generation: int) -> bool:
    """Both engine roles at the new spec (their controllers saw it, the pods replaced, a surge's extra
    pods gone) and Ready."""
    status = served.get("dllm", NAME).get("status", {})
    done = all(
        status.get(role, {}).get("updatedReplicas") == status.get(role, {}).get("replicas") == 1
        for role in ("prefill", "decode")
    )
    said = {c["type"]: c for c in status.get("conditions", [])}
    ready = said.get("Ready", {}).get("status") == "True"
    complete = said.get("RolloutProgressing", {}).get("reason") == "Complete"
    return done and ready and complete and status.get("observedGeneration") == generation


@dataclass(frozen=True)
class RollOutcomes:
    """Every request's outcome, of every client, during one roll."""

    outcomes: list[Outcome]

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.accepted_and_failed]

    def served_count(self) -> int:
        return sum(o.status == 200 for o in self.outcomes)


def roll_under_load(served: Served, patch: dict[str, Any], prefix: str, clients: int = 1) -> RollOutcomes:
    """Patch the CR while `clients` trickles run side by side (so a pod is more often replaced with a
    request in it); return once both roles rolled, are Ready and each client was served after that."""
    before = served.get("dllm", NAME)["metadata"]["generation"]
    with contextlib.ExitStack() as stack:
        trickles = [stack.enter_context(Trickle(served, f"{prefix}c{i}")) for i in range(clients)]

        def each_sent(count: int) -> bool:
            return all(len(t.outcomes) >= count for t in trickles)

        wait_until(lambda: each_sent(3), 120, "the first requests of each client")
        served.cluster.run("patch", "dllm", NAME, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch))
        # Every 2 s: each look is a kubectl process, and the engines share the machine's two cores.
        what = "both roles rolled to the new spec and Ready"
        wait_until(lambda: rolled(served, before + 1), 900, what, interval=2.0)
        after = [len(t.outcomes) for t in trickles]

        def each_served_after() -> bool:
            return all(
                any(o.status == 200 for o in t.outcomes[n:]) for t, n in zip(trickles, after, strict=True)
            )

        wait_until(each_served_after, 180, "a 200 for each client after the roll")
    return RollOutcomes([o for t in trickles for o in t.outcomes])
