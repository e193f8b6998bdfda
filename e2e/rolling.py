"""A spec change rolled out on the served sample while clients keep sending requests, and what each
request was told: shared by the node tier's rolling tests. A client sends one request after another,
plain or streamed (a stream keeps a request in flight for its whole answer, so pods are replaced with
requests running in them)."""

from __future__ import annotations

import contextlib
import errno
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Self

from e2e.fixtures import wait_until
from e2e.served_sample import NAME, NAMESPACE, PROMPTS, Served, completion

# Tokens per streamed answer: a second or more on the CPU sample, so a replaced pod has one in flight.
STREAM_TOKENS = 48

# A 503 naming the role with no ready pod: refused up front, never accepted by an engine.
REFUSED = frozenset({"no_prefill", "no_decode"})

# The connection never opened because the path to the Service had no route: the request reached no
# part of the product. A client retries those as OpenAI's SDK does (twice, after a pause); a refused
# connection (ECONNREFUSED: the Service had no endpoint) is not retried, it counts against the roll.
UNROUTED = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH})
CONNECT_RETRIES = 2


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
        return (self.status != 200 or bool(self.kind)) and not self.refused


def unrouted(error: BaseException) -> bool:
    """A connect that failed for want of a route (urllib wraps the OSError in a URLError)."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    return isinstance(reason, OSError) and reason.errno in UNROUTED


def streamed(router: str, prompt: str, timeout: float, request_id: str) -> tuple[int, str, str]:
    """One streamed completion read to its end: (status, error type, message). A 200 whose stream
    carries an error event or ends without [DONE] is a failure (status 200 with that error type)."""
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,  # the whole answer streams, not what the model says before its end token
        "stream": True,
    }
    request = urllib.request.Request(  # noqa: S310 (the router Service of the local cluster)
        router + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            events = [
                line[6:].strip()
                for line in response.read().decode().splitlines()
                if line.startswith("data: ")
            ]
    except urllib.error.HTTPError as error:
        answer = json.loads(error.read() or b"{}")
        problem = answer.get("error", {}) if isinstance(answer.get("error"), dict) else {}
        return int(error.code), str(problem.get("type", "")), str(problem.get("message", answer))[:300]
    chunks = [json.loads(event) for event in events if event.startswith("{")]
    errors = [chunk["error"] for chunk in chunks if isinstance(chunk.get("error"), dict)]
    if errors:
        return 200, str(errors[0].get("type", "stream_error")), str(errors[0].get("message", ""))[:300]
    if not events or events[-1] != "[DONE]":
        return 200, "stream_cut", f"{len(events)} events, the last {events[-1:]}"
    # An engine that aborts a request (a drain caught it) ends its stream cleanly with another reason.
    texts = [c["choices"][0] for c in chunks if c.get("choices")]
    reasons = [choice.get("finish_reason") for choice in texts if choice.get("finish_reason")]
    if reasons != ["length"]:
        return 200, "stream_short", f"finish reasons {reasons}, {len(texts)} chunks"
    return 200, "", ""


@dataclass
class Trickle:
    """One request after another through the router, each with its own X-Request-Id (so a failure can
    be found in both engines' logs), until stopped; streamed when `stream`."""

    served: Served
    prefix: str
    stream: bool = False
    prompt: str = PROMPTS[1]
    outcomes: list[Outcome] = field(default_factory=list)
    unrouted: list[Outcome] = field(default_factory=list)  # connects retried: no route to the Service
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _send(self, rid: str) -> Outcome:
        # Long enough for a restarted engine's first request on two busy cores.
        if self.stream:
            status, kind, message = streamed(self.served.router, self.prompt, 600, rid)
            return Outcome(rid, status, kind, message)
        status, body = completion(self.served.router, self.prompt, timeout=600, request_id=rid)
        problem = body.get("error", {}) if isinstance(body.get("error"), dict) else {}
        message = "" if status == 200 else str(problem.get("message", body))[:300]
        return Outcome(rid, status, str(problem.get("type", "")), message)

    def _run(self) -> None:
        deadline = time.monotonic() + 1800
        while not self._stop.is_set() and time.monotonic() < deadline:
            rid = f"{self.prefix}-{len(self.outcomes)}"
            for attempt in range(CONNECT_RETRIES + 1):
                try:
                    outcome = self._send(rid)
                except Exception as error:  # noqa: BLE001 - any failure is an outcome (a cut stream, a non-JSON body)
                    outcome = Outcome(rid, 0, type(error).__name__, repr(error)[:300])
                    if unrouted(error) and attempt < CONNECT_RETRIES:
                        self.unrouted.append(outcome)
                        self._stop.wait(0.5 * (attempt + 1))
                        continue
                break
            self.outcomes.append(outcome)
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
    """Every request's outcome, of every client, during one roll, and the connects retried for want of a
    route to the Service (each then counted by its retry's outcome)."""

    outcomes: list[Outcome]
    unrouted: list[Outcome] = field(default_factory=list)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.accepted_and_failed]

    def not_served(self) -> list[Outcome]:
        """Every request without its whole answer: failed, cut or refused up front."""
        return [o for o in self.outcomes if o.status != 200 or o.kind]

    def served_count(self) -> int:
        return sum(o.status == 200 for o in self.outcomes)


def roll_under_load(
    served: Served, patch: dict[str, Any], prefix: str, clients: int = 1, stream: bool = False
) -> RollOutcomes:
    """Patch the CR while `clients` trickles run side by side (so a pod is more often replaced with a
    request in it); return once both roles rolled, are Ready and each client was served after that."""
    before = served.get("dllm", NAME)["metadata"]["generation"]
    with contextlib.ExitStack() as stack:
        trickles = [stack.enter_context(Trickle(served, f"{prefix}c{i}", stream)) for i in range(clients)]

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
                any(o.status == 200 and not o.kind for o in t.outcomes[n:])
                for t, n in zip(trickles, after, strict=True)
            )

        wait_until(each_served_after, 180, "a 200 for each client after the roll")
    return RollOutcomes([o for t in trickles for o in t.outcomes], [o for t in trickles for o in t.unrouted])
