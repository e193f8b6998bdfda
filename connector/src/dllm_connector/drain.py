"""preStop drain: wait until the local vLLM engine has stayed idle for a settle time, or time runs out.

Usage (rendered by the operator): python3 -m dllm_connector.drain --port 8000 --timeout 110
Reads vLLM's Prometheus gauges on /metrics: vllm:num_requests_running and vllm:num_requests_waiting,
plus, on a prefill engine, vllm:dllm_kv_sends_in_flight (finished requests whose KV push still runs:
vLLM would otherwise stop under them, M4; the connector exports it, dllm_connector.connector).

One reading of 0 is not enough (security review M4): the router keeps sending new requests to this pod
until its DNS refresh drops it (a 5 s resolve interval plus DNS caching), so the engine counts as
drained only after at least `zeros` consecutive readings of 0 spanning `settle` seconds (15 by
default); any busy reading starts the count again. A request that came and went between two readings
leaves the gauges at 0, so a reading whose count of finished requests (vllm:request_success) moved
since the one before is busy too: the settle time runs from the last request, not from before it.
An engine that cannot be reached is done: the drain must not hold up the shutdown of a pod whose engine
is gone. Always exits 0.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import urllib.request
from dataclasses import dataclass

from dllm_contract.router_defaults import DEFAULT_HTTP_PORT

_GAUGE = re.compile(
    r"^vllm:(?:num_requests_running|num_requests_waiting|dllm_kv_sends_in_flight)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$",
    re.MULTILINE,
)

_FINISHED = re.compile(r"^vllm:request_success_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.MULTILINE)

DEFAULT_SETTLE_S = 15.0
DEFAULT_ZEROS = 3
# A scrape of /metrics is a few kB; a larger answer is not vLLM's and is not read to its end.
_MAX_METRICS_BYTES = 8 << 20


def in_flight(metrics_text: str) -> int:
    """Running plus waiting requests plus KV sends in flight, summed over every label set."""
    return int(sum(float(value) for value in _GAUGE.findall(metrics_text)))


def finished(metrics_text: str) -> int:
    """Requests the engine has finished so far, summed over every label set."""
    return int(sum(float(value) for value in _FINISHED.findall(metrics_text)))


@dataclass(frozen=True)
class Reading:
    in_flight: int
    finished: int


def read_engine(port: int) -> Reading | None:
    """The engine's in-flight and finished requests, or None when it cannot be reached (or answers an
    error)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read(_MAX_METRICS_BYTES).decode(errors="replace")
        return Reading(in_flight(text), finished(text))
    except (OSError, ValueError):  # refused, reset, timed out, HTTP errors; a malformed number
        return None


@dataclass
class Settling:
    """Consecutive idle readings: when the current run of zeros began and how long it is."""

    zeros: int = 0
    since: float = 0.0

    def note(self, count: int, now: float) -> None:
        if count:
            self.zeros = 0
            return
        if self.zeros == 0:
            self.since = now
        self.zeros += 1

    def settled(self, now: float, zeros: int, settle: float) -> bool:
        return self.zeros >= zeros and now - self.since >= settle


def drain(
    port: int,
    timeout: float,
    interval: float = 1.0,
    *,
    settle: float = DEFAULT_SETTLE_S,
    zeros: int = DEFAULT_ZEROS,
) -> bool:
    """True once the engine was idle for `zeros` readings over `settle` seconds, or is unreachable."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    idle = Settling()
    before: Reading | None = None
    while True:
        reading = read_engine(port)
        now = time.monotonic()
        if reading is None:  # the engine is gone
            return True
        came_and_went = before is not None and reading.finished != before.finished
        idle.note(reading.in_flight + came_and_went, now)
        before = reading
        if idle.settled(now, zeros, settle):
            return True
        if now >= deadline:
            return False
        pause.wait(min(interval, max(deadline - now, 0.0)))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm_connector.drain")
    parser.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT)
    parser.add_argument("--timeout", type=float, default=110)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    parser.add_argument(
        "--settle",
        type=float,
        default=DEFAULT_SETTLE_S,
        help="seconds the engine must stay idle (covers the router's DNS refresh)",
    )
    parser.add_argument("--zeros", type=int, default=DEFAULT_ZEROS, help="idle readings needed, at least")
    args = parser.parse_args()
    drained = drain(args.port, args.timeout, args.interval, settle=args.settle, zeros=args.zeros)
    print(
        "drained" if drained else f"not idle for {args.settle:.0f}s by {args.timeout:.0f}s: stopping anyway",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
