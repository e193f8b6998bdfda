"""Reconcile speed of the operator on the cluster KUBECONFIG names (the local control plane by default).

Side by side in one run:
  create-to-children  CR created -> every child seen by a watch; the operator vs the floor (the same
                      rendered children applied directly by this client, no operator in between),
                      floor and operator CRs interleaved one by one, each created once the
                      previous one has settled (its pods Ready; for the operator, the CR Ready)
  ready-to-status     a pod turned Ready (status patch) -> the CR's Ready=True seen by a watch
  bulk                N CRs at once -> all Ready; operator writes per CR in an idle period after
                      (audit log, leases excluded); the operator's peak RSS
  roll (--roll)       the bulk CRs (made with spec.rollout.maxSurge 1) all changed at once in their KV
                      fingerprint (compression none -> fp8): the time until every surge rollout has
                      completed (each CR's status: RolloutProgressing Complete, every pod of both roles
                      at the new fingerprint), and the operator's writes meanwhile, by verb

Usage: python bench/reconcile.py [--quick] [--bulk N] [--roll]   (needs `make cluster-up`; run from
the repository root). Issue 34's run: --bulk 500 --roll.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from e2e.cluster import controlplane as cp  # noqa: E402
from e2e.fixtures import operator_writes  # noqa: E402
from e2e.operator_process import OperatorProcess  # noqa: E402
from e2e.samples import cpu_sample_on_kwok  # noqa: E402

from dllm_operator.api import parse  # noqa: E402
from dllm_operator.kube import KubeClient, load_credentials  # noqa: E402
from dllm_operator.render import render_all  # noqa: E402

CHILD_KINDS = ("statefulsets", "deployments", "services")
READY_FORMAT = 'jsonpath={.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
_PAUSE = threading.Event()


def kubectl(layout: cp.Layout, *args: str, input_text: str | None = None) -> str:
    return cp.kubectl(layout, *args, input_text=input_text)


class Watcher:
    """`kubectl get --watch` per kind in one namespace; first time each name was seen, and status lines."""

    def __init__(self, layout: cp.Layout, namespace: str, kind: str, fmt: str) -> None:
        self.seen: dict[str, float] = {}
        self.lines: list[tuple[float, str]] = []
        self._process = subprocess.Popen(
            [str(layout.kubectl), f"--kubeconfig={layout.kubeconfig}", "get", kind, "-n", namespace,
             "--watch", "-o", fmt], stdout=subprocess.PIPE, text=True, bufsize=1)  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            now = time.monotonic()
            name = line.split()[0] if line.split() else ""
            self.seen.setdefault(name, now)
            self.lines.append((now, line.strip()))

    def stop(self) -> None:
        self._process.terminate()


def cr_body(name: str, surge: bool = False) -> dict[str, Any]:
    body = cpu_sample_on_kwok()
    body["metadata"] = {"name": name}
    if surge:
        body["spec"]["rollout"] = {"maxSurge": 1}
    return body


def rolled(cr: dict[str, Any], since: str) -> bool:
    """The CR's surge rollout completed after `since`: every pod of both roles at the template's
    fingerprint, and RolloutProgressing Complete."""
    status = cr.get("status", {})
    if status.get("rollout", {}).get("completedAt", "") < since:
        return False
    for role in ("prefill", "decode"):
        seen = status.get(role, {})
        if [f.get("fingerprint") for f in seen.get("podFingerprints", [])] != [seen.get("kvFingerprint")]:
            return False
    conditions: list[dict[str, Any]] = status.get("conditions", [])
    return any(c["type"] == "RolloutProgressing" and c.get("reason") == "Complete" for c in conditions)


def rolled_count(layout: cp.Layout, namespace: str, since: str) -> int:
    items = json.loads(kubectl(layout, "get", "dllm", "-n", namespace, "-o", "json"))["items"]
    return sum(rolled(item, since) for item in items)


def child_names(name: str) -> list[str]:
    return [f"{name}-prefill", f"{name}-decode", f"{name}-router"]


def wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        _PAUSE.wait(0.05)


class ChildTimer:
    """Create CRs in one namespace and time each until all its children are seen by the watches."""

    def __init__(self, layout: cp.Layout, namespace: str, floor: bool) -> None:
        self.layout, self.namespace, self.floor = layout, namespace, floor
        self.watchers = [Watcher(layout, namespace, kind, "name") for kind in CHILD_KINDS]
        self.pods = Watcher(layout, namespace, "pods", READY_FORMAT)
        # Its own user agent: the audit log counts the operator's writes by the operator's.
        self.client = KubeClient(load_credentials(str(layout.kubeconfig)), user_agent="dllm-bench/0")
        self.loop = asyncio.new_event_loop()  # one loop and connection pool for all CRs, as an operator has
        self.latencies: list[float] = []

    def one(self, index: int) -> None:
        name = f"{'floor' if self.floor else 'op'}-{index:03d}"
        body = cr_body(name)
        body["metadata"]["namespace"] = self.namespace
        # The clock starts before the create, not once it has returned: the operator's watch may act
        # on the new resource before the client has read the API server's answer.
        start = time.monotonic()
        created = self.loop.run_until_complete(self.client.create(body))
        if self.floor:  # the physical floor: this client renders and applies the children itself
            children = render_all(parse(created))
            self.loop.run_until_complete(_apply_all(self.client, children))
        names = child_names(name)
        wait(lambda: _all_children_seen(self.watchers, names), 60, f"children of {name}")
        self.latencies.append(max(_child_times(self.watchers, names)) - start)
        # Settle before the next CR: its pods exist and are Ready, so no backlog is measured next time.
        wait(lambda: self._pods_ready(name), 60, f"the pods of {name} to be Ready")
        if not self.floor:
            wait(lambda: all_ready(self.layout, self.namespace, index + 1), 60, f"{name} Ready")

    def _pods_ready(self, name: str) -> bool:
        latest: dict[str, str] = {}
        for _, line in list(self.pods.lines):
            pod, _, ready = line.partition(" ")
            if pod.startswith(f"{name}-"):
                latest[pod] = ready
        return len(latest) >= 3 and all(ready == "True" for ready in latest.values())

    def stop(self) -> None:
        for watcher in [*self.watchers, self.pods]:
            watcher.stop()
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def create_to_children(
    layout: cp.Layout, floor_ns: str, operator_ns: str, count: int
) -> tuple[list[float], list[float]]:
    """Floor and operator CRs interleaved (alternating which goes first), so both see the same machine."""
    floor, through = ChildTimer(layout, floor_ns, floor=True), ChildTimer(layout, operator_ns, floor=False)
    try:
        for index in range(count):
            for timer in (floor, through) if index % 2 == 0 else (through, floor):
                timer.one(index)
    finally:
        floor.stop()
        through.stop()
    return floor.latencies, through.latencies


def _seen(watcher: Watcher, name: str) -> bool:
    return any(key.endswith(f"/{name}") for key in watcher.seen)


def _all_children_seen(watchers: list[Watcher], names: list[str]) -> bool:
    """Two StatefulSets, the router Deployment, and the three Services."""
    statefulsets, deployments, services = watchers
    return (
        all(_seen(statefulsets, n) for n in names[:2])
        and _seen(deployments, names[2])
        and all(_seen(services, n) for n in names)
    )


def _child_times(watchers: list[Watcher], names: list[str]) -> list[float]:
    times = []
    for watcher in watchers:
        times += [t for key, t in watcher.seen.items() if key.rsplit("/", 1)[-1] in names]
    return times


async def _apply_all(client: KubeClient, children: list[dict[str, Any]]) -> None:
    await asyncio.gather(*(client.apply(child) for child in children))


def ready_status(cr: dict[str, Any]) -> str:
    return next((c["status"] for c in cr.get("status", {}).get("conditions", []) if c["type"] == "Ready"), "")


def ready_to_status(layout: cp.Layout, namespace: str, names: list[str]) -> list[float]:
    latencies = []
    watcher = Watcher(
        layout,
        namespace,
        "dllm",
        READY_FORMAT,
    )
    try:
        for name in names:
            pod = f"{name}-decode-0"
            for status in ("False", "True"):
                patch = {"status": {"conditions": [{"type": "Ready", "status": status}]}}
                mark = len(watcher.lines)
                kubectl(
                    layout,
                    "patch",
                    "pod",
                    pod,
                    "-n",
                    namespace,
                    "--subresource=status",
                    "--type=strategic",
                    "-p",
                    json.dumps(patch),
                )
                start = time.monotonic()

                def flipped(mark: int = mark, status: str = status, name: str = name) -> bool:
                    return any(line == f"{name} {status}" for _, line in watcher.lines[mark:])

                wait(flipped, 30, f"{name} Ready={status}")
                if status == "True":
                    seen = next(t for t, line in watcher.lines[mark:] if line == f"{name} True")
                    latencies.append(seen - start)
    finally:
        watcher.stop()
    return latencies


def all_ready(layout: cp.Layout, namespace: str, count: int) -> bool:
    items = json.loads(kubectl(layout, "get", "dllm", "-n", namespace, "-o", "json"))["items"]
    return sum(ready_status(i) == "True" for i in items) == count


def audit_entries(layout: cp.Layout) -> list[dict[str, Any]]:
    return [json.loads(line) for line in layout.audit_log.read_text().splitlines() if line.strip()]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def row(label: str, values: list[float]) -> str:
    return (
        f"  {label:<34} median {statistics.median(values) * 1000:7.1f} ms   p95 {p95(values) * 1000:7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small counts: finishes in under 150 s")
    parser.add_argument("--bulk", type=int, help="CRs created at once (default 100; 30 with --quick)")
    parser.add_argument("--roll", action="store_true", help="then change every bulk CR's KV fingerprint")
    args = parser.parse_args()
    latency_count, bulk_count, idle = (10, 30, 20.0) if args.quick else (50, 100, 120.0)
    bulk_count = args.bulk or bulk_count
    layout = cp.up()
    kubectl(
        layout,
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        str(ROOT / "crds" / "disaggregatedllms.disagg.dev.yaml"),
    )
    stamp = time.strftime("%H%M%S")
    watched, floor_ns, bulk_ns = f"bench-op-{stamp}", f"bench-floor-{stamp}", f"bench-bulk-{stamp}"
    for namespace in (watched, floor_ns, bulk_ns):
        kubectl(layout, "create", "namespace", namespace)
    # Room for every pod: 110 pods and 96 CPUs per fake node (3 pods, 2.5 CPUs per CR; a surge adds
    # one pod per engine role while it rolls).
    pods_per_cr = 5 if args.roll else 3
    extra_nodes = [
        f"bench-node-{i}" for i in range(max(6, -(-(latency_count + bulk_count) * pods_per_cr // 100)))
    ]
    for node in extra_nodes:
        kubectl(
            layout, "apply", "--server-side", "-f", "-", input_text=json.dumps(cp.fake_node(node, "zone-b"))
        )
    logs = Path(tempfile.mkdtemp(prefix="bench-reconcile-"))
    operator = OperatorProcess(layout.kubeconfig, [watched, bulk_ns], logs / "operator.log", watched).start()
    started = time.monotonic()
    try:
        print(
            f"create-to-children over {latency_count} CRs (operator log {logs / 'operator.log'})", flush=True
        )
        floor, through = create_to_children(layout, floor_ns, watched, latency_count)
        kubectl(layout, "delete", "namespace", floor_ns, "--wait=false")
        wait(lambda: all_ready(layout, watched, latency_count), 120, "the latency CRs to be Ready")
        print(row("floor (client applies children)", floor))
        print(row("operator", through))
        print(
            f"  ratio (median)                     "
            f"{statistics.median(through) / statistics.median(floor):.2f}x "
            "(goal <= 1.5x)"
        )
        print(f"ready-to-status over {min(latency_count, 10)} CRs", flush=True)
        ready = ready_to_status(layout, watched, [f"op-{i:03d}" for i in range(min(latency_count, 10))])
        print(row("pod Ready -> CR Ready=True", ready) + "   (goal: median < 1 s)")
        print(f"bulk: {bulk_count} CRs at once", flush=True)
        bulk_start = time.monotonic()
        kubectl(
            layout,
            "create",
            "-n",
            bulk_ns,
            "-f",
            "-",
            input_text=yaml.safe_dump_all([cr_body(f"bulk-{i:03d}", args.roll) for i in range(bulk_count)]),
        )
        wait(lambda: all_ready(layout, bulk_ns, bulk_count), max(300, 3 * bulk_count), "all bulk CRs Ready")
        print(f"  all {bulk_count} Ready after              {time.monotonic() - bulk_start:7.1f} s")
        since = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        deadline = time.monotonic() + idle
        while time.monotonic() < deadline:
            _PAUSE.wait(1)
        writes = len(operator_writes(audit_entries(layout), {bulk_ns, watched}, since))
        print(
            f"  operator writes in {idle:.0f} s idle        {writes} "
            f"({writes / bulk_count:.2f} per CR, goal 0)"
        )
        assert operator.process is not None
        print(
            f"  operator peak RSS                   "
            f"{peak_rss_mb(operator.process.pid):7.1f} MB (goal < 200 MB at 100 CRs, < 300 MB at 500)"
        )
        if args.roll:
            roll(layout, bulk_ns, bulk_count)
        print(f"total {time.monotonic() - started:.0f} s")
    finally:
        operator.stop()
        for namespace in (watched, floor_ns, bulk_ns):
            kubectl(layout, "delete", "namespace", namespace, "--wait=false", "--ignore-not-found")
        kubectl(layout, "delete", "node", *extra_nodes, "--wait=false")


def roll(layout: cp.Layout, namespace: str, count: int) -> None:
    """Every bulk CR's compression to fp8 at once; the time until all their surge rollouts complete."""
    print(f"roll: {count} CRs' KV fingerprint changed at once (compression none -> fp8)", flush=True)
    since = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    audit_since = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    began = time.monotonic()
    patch = json.dumps({"spec": {"kvTransfer": {"compression": "fp8"}}})
    names = [f"bulk-{i:03d}" for i in range(count)]
    for start in range(0, count, 50):  # one kubectl per 50 CRs: the patches land within seconds
        kubectl(
            layout, "patch", "dllm", "-n", namespace, "--type=merge", "-p", patch, *names[start : start + 50]
        )
    patched = time.monotonic() - began
    wait(
        lambda: rolled_count(layout, namespace, since) == count, max(600, 6 * count), "every rollout complete"
    )
    took = time.monotonic() - began
    writes = operator_writes(audit_entries(layout), {namespace}, audit_since)
    verbs: dict[str, int] = {}
    for entry in writes:
        key = f"{entry.get('verb')} {entry.get('objectRef', {}).get('resource')}"
        verbs[key] = verbs.get(key, 0) + 1
    print(f"  patches sent in                     {patched:7.1f} s")
    print(f"  every rollout complete after        {took:7.1f} s ({took / count * 1000:.0f} ms per CR)")
    print(f"  operator writes meanwhile           {len(writes)} ({len(writes) / count:.1f} per CR)")
    for key, number in sorted(verbs.items(), key=lambda kv: -kv[1]):
        print(f"    {key:<40} {number}")


if __name__ == "__main__":
    main()
