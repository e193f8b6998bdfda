"""preStop drain: wait until the local vLLM engine has no running or waiting request, or time runs out.

Usage (rendered by the operator): python3 -m dllm_connector.drain --port 8000 --timeout 110
Reads vLLM's Prometheus gauges (vllm:num_requests_running / vllm:num_requests_waiting) on /metrics.
Always exits 0: a drain that cannot reach the engine must not block the pod's shutdown.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import urllib.request

_GAUGE = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.MULTILINE)


def in_flight(metrics_text: str) -> int:
    """Running plus waiting requests, summed over every label set."""
    return int(sum(float(value) for value in _GAUGE.findall(metrics_text)))


def read_in_flight(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return in_flight(response.read().decode())
    except OSError:
        return None


def drain(port: int, timeout: float, interval: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < deadline:
        count = read_in_flight(port)
        if not count:  # 0, or the engine is gone
            return True
        pause.wait(interval)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm_connector.drain")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=110)
    args = parser.parse_args()
    drained = drain(args.port, args.timeout)
    print("drained" if drained else f"still busy after {args.timeout:.0f}s: stopping anyway", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
