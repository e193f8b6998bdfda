"""The CPU sample as `make demo` deploys it on the real node (python -m e2e.demo up, then down), and what
the node serving tests (e2e/tests/test_node_serving.py) send to it and read from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dllm_operator.render.ports import TRANSFER_PORTS_ENV
from e2e import demo, models_volume, node_leftovers
from e2e.cluster import controlplane as cp
from e2e.cluster import node, nodehost
from e2e.dataplane.pipeline import counter, metrics_text, post_json
from e2e.fixtures import Cluster, WaitTimeout, wait_until
from e2e.processes import descendants

NAMESPACE = "node-serving"
NAME = demo.NAME
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "0123456789 abcdefghij KLMNOPQRST " * 2]
MAX_TOKENS = 12
SAMPLE_PODS = f"app.kubernetes.io/instance={NAME}"  # both engines and the router
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Served:
    cluster: Cluster
    layout: cp.Layout
    model: Path
    demo_output: str  # what `python -m e2e.demo up` printed

    def get(self, *args: str) -> Any:
        return self.cluster.get_json(*args, "-n", NAMESPACE)

    @property
    def router(self) -> str:
        service = self.get("service", f"{NAME}-router")
        return f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"

    def engine_pod(self, role: str, place: int = 0) -> str:
        """The name of the role's pod at `place` in its window of ordinals (demo.engine_pod_name)."""
        return demo.engine_pod_name(self.layout, NAMESPACE, role, place)

    def pod_url(self, pod: str) -> str:
        return f"http://{self.get('pod', pod)['status']['podIP']}:8000"

    @property
    def router_pod(self) -> str:
        """The one router pod's own URL: its counters are its own (through the Service, with several
        routers, any one's would answer)."""
        pods = self.get("pods", "-l", f"{SAMPLE_PODS},app.kubernetes.io/component=router")["items"]
        running = [p for p in pods if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")]
        assert len(running) == 1, [p["metadata"]["name"] for p in running]
        port = running[0]["spec"]["containers"][0]["ports"][0]["containerPort"]
        return f"http://{running[0]['status']['podIP']}:{port}"

    def why_restarted(self, pod: str) -> str:
        """The container's last state and the end of its previous run's log: what a restart left."""
        status = self.get("pod", pod)["status"]["containerStatuses"][0]
        previous = self.cluster.run("logs", "--previous", "--tail=40", "-n", NAMESPACE, pod, check=False)
        return f"{pod} restarted: {status.get('lastState')}\n{previous.stdout}{previous.stderr}"

    def engine_logs(self) -> str:
        """The last lines each engine logged but the noise (what a 500 from vLLM names only as an
        internal error): the demo's own reader."""
        return demo.engine_logs(self.layout, NAMESPACE)

    def condition(self, kind: str) -> dict[str, Any]:
        cr = self.get("dllm", NAME)
        return next((c for c in cr.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DLLM_DEMO_NAMESPACE=NAMESPACE)
    return subprocess.run([sys.executable, "-m", "e2e.demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200, check=False)  # fmt: skip


def deployed(cluster: Cluster) -> Iterator[Served]:
    """The sample deployed by `make demo`'s own command, for as long as the caller holds it (each deploy
    costs minutes of engine start and compile on two cores); `make demo-down`'s command removes it and
    what it leaves behind is checked."""
    layout = cp.Layout.from_env()
    if not node.running(layout):
        pytest.fail(f"the real node is not running: {node.why_not(layout)}")
    # What an interrupted run left: a model PV still terminating would leave the claim unbound.
    demo.undeploy(layout, NAMESPACE)
    namespaces = (NAMESPACE, demo.SYSTEM_NAMESPACE)
    node_before = node_leftovers.snapshot(layout, namespaces)
    try:
        up = run_demo("up", "--timeout", "900")
        assert up.returncode == 0, up.stdout[-8000:] + up.stderr[-8000:]
        served = Served(cluster, layout, models_volume.make_model(), up.stdout)
        # Ready (the CR's) comes a moment before the router's own checks have seen both engines.
        wait_until(lambda: demo.answers(served.router + "/ready"), 60, "the router's /ready")
        # The first request of a fresh engine pair is the slowest (the sample runs vLLM's sampler eager,
        # so no compile, but two busy cores): a generous bound.
        status, body = completion(served.router, PROMPTS[0], timeout=600)
        assert status == 200, f"{body}\n{served.engine_logs()}"
        yield served
    finally:
        down = run_demo("down", "--keep-cluster")
    assert down.returncode == 0, down.stderr
    assert cluster.helm("list", "-n", demo.SYSTEM_NAMESPACE, "-q").stdout.strip() == ""
    # Deleting the CR and uninstalling leaves nothing of ours: the namespace, its model volume, the
    # chart's cluster-scoped objects, the operator's pods, and on the node containers, sandboxes, veths,
    # IP allocations, kube-proxy's rules and kube-router's chains and ipsets.
    gone = cluster.run("get", "namespace", NAMESPACE, "--ignore-not-found", "-o", "name").stdout
    assert gone.strip() == ""
    volume = ("get", "pv", models_volume.volume_name(NAMESPACE), "--ignore-not-found", "-o", "name")
    assert cluster.run(*volume).stdout.strip() == ""
    chart_kinds = "clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding"
    release = f"app.kubernetes.io/instance={demo.RELEASE}"
    assert cluster.run("get", chart_kinds, "-l", release, "-o", "name").stdout.strip() == ""
    operator_pods = ("get", "pods", "-n", demo.SYSTEM_NAMESPACE, "-o", "name")
    wait_until(lambda: cluster.run(*operator_pods).stdout.strip() == "", 120, "the operator pod to go")

    left: list[dict[str, list[str]]] = []

    def nothing_left_on_the_node() -> bool:
        left.append(node_leftovers.added(node_before, node_leftovers.snapshot(layout, namespaces)))
        return not left[-1]

    try:
        wait_until(nothing_left_on_the_node, 120, "the node to hold nothing of the deployment")
    except WaitTimeout:
        raise AssertionError(f"left on the node after the deployment was removed: {left[-1]}") from None

    def rules_of_ours() -> list[str]:
        rules = nodehost.in_netns("iptables-save").stdout.splitlines()
        return [rule for rule in rules if f"{NAMESPACE}/" in rule or f"{demo.SYSTEM_NAMESPACE}/" in rule]

    wait_until(lambda: not rules_of_ours(), 60, "kube-proxy's rules for our Services to go")


def completion(
    url: str, prompt: str, timeout: float = 120, request_id: str | None = None
) -> tuple[int, dict[str, Any]]:
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
    }
    headers = {"X-Request-Id": request_id} if request_id else None
    return post_json(url + "/v1/completions", body, timeout=timeout, headers=headers)


def tokens(body: dict[str, Any]) -> list[str]:
    return list(body["choices"][0]["logprobs"]["tokens"])


def listening_ports(cluster: Cluster, pod: str, namespace: str) -> set[int]:
    """TCP ports the pod listens on beyond loopback, from its own /proc/net/tcp{,6} (state 0A)."""
    out = cluster.run("exec", pod, "-n", namespace, "--", "cat", "/proc/net/tcp", "/proc/net/tcp6").stdout
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.lstrip().startswith("sl")]
    loopback = ("0100007F", "00000000000000000000000001000000")
    return {
        int(port, 16)
        for _, local, _, state, *_ in rows
        for address, port in [local.rsplit(":", 1)]
        if state == "0A" and address not in loopback
    }


def engine_ports(pod: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(declared container ports: HTTP and each rank's KV side channel, Mooncake's range) as rendered."""
    [container] = pod["spec"]["containers"]
    declared = [int(p["containerPort"]) for p in container["ports"]]
    value = next(e["value"] for e in container["env"] if e["name"] == TRANSFER_PORTS_ENV)
    low, high = (int(v) for v in value.split("-"))
    return declared, list(range(low, high + 1))


def connect_from_engine(cluster: Cluster, pod: str, namespace: str, addrs: list[str]) -> dict[str, str]:
    """TCP connects from inside an engine pod (its image has Python, not the probe)."""
    script = (
        "import socket, sys, json\n"
        "out = {}\n"
        "for a in sys.argv[1:]:\n"
        "    h, p = a.rsplit(':', 1)\n"
        "    try:\n"
        "        socket.create_connection((h, int(p)), timeout=3).close(); out[a] = 'open'\n"
        "    except OSError as e:\n"
        "        out[a] = type(e).__name__\n"
        "print(json.dumps(out))\n"
    )
    result = cluster.run("exec", pod, "-n", namespace, "--", "python3", "-c", script, *addrs, timeout=300)
    return dict(json.loads(result.stdout))


def stream_first_event(url: str) -> tuple[Any, bytes]:
    body = {
        "model": "tiny-llama",
        "prompt": "stream " * 20,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,  # the model's end token must not end the stream before the kill
        "stream": True,
    }
    request = urllib.request.Request(  # noqa: S310 (a ClusterIP of the local cluster)
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=120)  # noqa: S310
    return response, response.readline()


def stream_frozen_mid_way(served: Served, pid: int, attempts: int = 5) -> tuple[Any, bytes]:
    """A stream from the router whose decode (engine main process `pid`) is frozen, every process of
    it stopped, after the first event while the stream is still open: a kill that follows lands
    mid-stream. On a loaded host decode may finish all its tokens before the freeze (the router relays
    the first event late); such an attempt is let go (decode thawed, the stream read out) and another
    made. Decode's stream is open while the router counts a decode call in flight."""
    for _ in range(attempts):
        response, first = stream_first_event(served.router)
        frozen = [pid, *descendants(pid)]
        for process in frozen:
            os.kill(process, signal.SIGSTOP)
        try:  # a finished stream leaves the router's count within moments; a frozen one never
            wait_until(lambda: decode_calls_in_flight(served.router) == 0, 2, "decode's stream to end")
        except WaitTimeout:
            return response, first
        for process in frozen:
            os.kill(process, signal.SIGCONT)
        response.read()
        response.close()
    raise AssertionError(f"decode finished every stream before it could be frozen, {attempts} times")


def decode_calls_in_flight(router: str) -> float:
    return counter(metrics_text(router), "dllm_router_inflight", role="decode")


def engine_pid(served: Served, pod_name: str) -> int:
    """The engine container's main process, as the host sees it (looked up before the stream starts,
    so that the kill lands while tokens still flow)."""
    container_id = served.get("pod", pod_name)["status"]["containerStatuses"][0]["containerID"].split("//")[1]
    tasks = node.ctr(served.layout, "tasks", "ls").splitlines()[1:]
    return next(int(line.split()[1]) for line in tasks if line.split()[0] == container_id)


def faulty_cr(name: str, **prefill: Any) -> dict[str, Any]:
    """The sample with a broken prefill (no model volume needed: it never gets that far)."""
    body = yaml.safe_load(demo.SAMPLE.read_text())
    body["metadata"] = {"name": name, "namespace": NAMESPACE}
    body["spec"]["model"].pop("source")
    body["spec"]["prefill"].update(prefill)
    body["spec"]["decode"]["replicas"] = 0
    body["spec"]["router"]["enabled"] = False
    return dict(body)
