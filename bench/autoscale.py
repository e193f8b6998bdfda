"""PD autoscaling against fixed topologies, on the CPU sample that `make demo` runs on the real node.

One replayed load, phases of short and of long prompts from closed-loop streaming clients, runs against
each of three topologies of the same resource, interleaved round by round (the order rotates):

  1P1D        prefill 1, decode 1, autoscaling off
  1P2D        prefill 1, decode 2, autoscaling off
  autoscaler  spec.autoscaling active for prefill (time to first token) from 1P1D, min 1, max 2

Per run: requests answered whose first token came within the time-to-first-token target, the engine
replica-seconds spent (ready prefill and decode pods, sampled every second), and their ratio (the
figure of merit: answers within the target per replica-second). The ratios to 1P1D are printed per
round, then medians over rounds. The machine has two cores shared by every engine, so a second pod
adds no compute here: what the autoscaler can win on it is replica-seconds, not latency; on GPUs a
pod is a GPU.

Usage: make demo (leaves the sample running in namespace demo), then
  python bench/autoscale.py [--rounds 3] [--phase-seconds 120] [--target-ttft 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import demo  # noqa: E402
from e2e.cluster import controlplane as cp  # noqa: E402

SHORT = "0123456789 abcdefghij KLMNOPQRST " * 2  # 66 bytes: 66 tokens of the byte-level tiny model
LONG = "The quick brown fox jumps over the lazy dog. " * 10  # 450 of the sample's 512 tokens
# (prompt, clients) per phase: a burst of long prompts between two quiet phases
PHASES = [(SHORT, 1), (LONG, 3), (SHORT, 1)]
MAX_TOKENS = 12
_PAUSE = threading.Event()  # never set: wait(t) is an interruptible pause


@dataclass
class Run:
    topology: str
    answered: int = 0
    within: int = 0
    failed: int = 0
    replica_seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    @property
    def merit(self) -> float:
        return self.within / self.replica_seconds if self.replica_seconds else 0.0


class Cluster:
    def __init__(self, namespace: str) -> None:
        self.layout, self.namespace = cp.Layout.from_env(), namespace

    def kubectl(self, *args: str) -> str:
        return demo.tool(self.layout, "kubectl", *args, "-n", self.namespace)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def patch(self, patch: dict[str, Any]) -> None:
        self.kubectl("patch", "dllm", demo.NAME, "--type=merge", "-p", json.dumps(patch))

    def router(self) -> str:
        service = self.get("service", f"{demo.NAME}-router")
        return f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"

    def workloads(self) -> dict[str, Any]:
        return {role: self.get("statefulset", f"{demo.NAME}-{role}") for role in ("prefill", "decode")}

    def ready_pods(self) -> dict[str, int]:
        return {role: ready_of(sts) for role, sts in self.workloads().items()}


def ready_of(sts: dict[str, Any]) -> int:
    return int(sts.get("status", {}).get("readyReplicas") or 0)


TOPOLOGIES: dict[str, dict[str, Any]] = {
    "1P1D": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "autoscaling": {"mode": "off"}},
    "1P2D": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}, "autoscaling": {"mode": "off"}},
}


def autoscaler(target_ttft: float) -> dict[str, Any]:
    return {
        "prefill": {"replicas": None},
        "decode": {"replicas": 1},
        "autoscaling": {
            "mode": "active",
            "prefill": {
                "minReplicas": 1,
                "maxReplicas": 2,
                "target": {"timeToFirstTokenSeconds": target_ttft},
            },
            "decode": None,
            "scaleDownStabilizationSeconds": 30,
        },
    }


def settle(cluster: Cluster, want: dict[str, int], timeout: float = 900) -> None:
    """Until the roles run exactly `want` ready pods and the resource is Ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cr = cluster.get("dllm", demo.NAME)
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in cr.get("status", {}).get("conditions", [])
        )
        workloads = cluster.workloads()
        counts = {role: sts["spec"].get("replicas") for role, sts in workloads.items()}
        if ready and counts == want and {role: ready_of(sts) for role, sts in workloads.items()} == want:
            return
        _PAUSE.wait(2)
    raise TimeoutError(f"the sample did not settle at {want}")


def first_token_seconds(router: str, prompt: str) -> float | None:
    """One streamed completion: seconds to its first token, None when it failed."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    request = urllib.request.Request(  # noqa: S310 (the local cluster's router Service)
        router + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started, first = time.monotonic(), None
    try:
        with urllib.request.urlopen(request, timeout=600) as response:  # noqa: S310
            for line in response:
                if line.startswith(b"data: {") and first is None:
                    first = time.monotonic() - started
                if line.strip() == b"data: [DONE]":
                    return first
    except (urllib.error.URLError, OSError):
        return None
    return None


def replay(cluster: Cluster, topology: str, phase_seconds: float, target: float) -> Run:
    run, router, lock = Run(topology), cluster.router(), threading.Lock()
    stop_sampling = threading.Event()

    def sample() -> None:
        last = time.monotonic()
        while not stop_sampling.wait(1.0):
            pods = sum(cluster.ready_pods().values())
            now = time.monotonic()
            run.replica_seconds += pods * (now - last)
            last = now

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for prompt, clients in PHASES:
        until = time.monotonic() + phase_seconds

        def client(prompt: str = prompt, until: float = until) -> None:
            while time.monotonic() < until:
                ttft = first_token_seconds(router, prompt)
                with lock:
                    if ttft is None:
                        run.failed += 1
                    else:
                        run.answered += 1
                        run.within += ttft <= target
                        run.ttfts.append(ttft)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    stop_sampling.set()
    sampler.join()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/autoscale.py")
    parser.add_argument("--namespace", default="demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase-seconds", type=float, default=120)
    parser.add_argument("--target-ttft", type=float, default=1.0, help="seconds; also the autoscaler's")
    args = parser.parse_args()
    cluster = Cluster(args.namespace)
    names = ["1P1D", "1P2D", "autoscaler"]
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for round_no in range(args.rounds):
        order = names[round_no % 3 :] + names[: round_no % 3]
        for name in order:
            patch = autoscaler(args.target_ttft) if name == "autoscaler" else TOPOLOGIES[name]
            cluster.patch({"spec": patch})
            settle(cluster, {"prefill": 1, "decode": 2 if name == "1P2D" else 1})
            run = replay(cluster, name, args.phase_seconds, args.target_ttft)
            runs[name].append(run)
            p50 = statistics.median(run.ttfts) if run.ttfts else float("nan")
            print(f"round {round_no + 1} {name:10s} answered {run.answered:4d} within {run.within:4d} "
                  f"failed {run.failed} replica-s {run.replica_seconds:7.1f} ttft p50 {p50:.2f}s "
                  f"merit {run.merit:.4f}", flush=True)  # fmt: skip
        base = runs["1P1D"][-1].merit
        print(
            "  vs 1P1D: " + ", ".join(f"{n} {runs[n][-1].merit / base:.2f}x" for n in names if base),
            flush=True,
        )
    cluster.patch({"spec": TOPOLOGIES["1P1D"]})
    print("\nmedians over rounds (answers within the target per replica-second, and ratio to 1P1D):")
    base = statistics.median(r.merit for r in runs["1P1D"])
    for name in names:
        merit = statistics.median(r.merit for r in runs[name])
        replica_s = statistics.median(r.replica_seconds for r in runs[name])
        within = statistics.median(r.within for r in runs[name])
        print(
            f"  {name:10s} merit {merit:.4f} ({merit / base:.2f}x) "
            f"within {within:.0f} replica-s {replica_s:.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
