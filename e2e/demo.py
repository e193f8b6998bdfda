"""`make demo`: the product as a user runs it, on the local cluster's real node.

1. the local cluster: control plane, kwok's GPU nodes and one real node (built once per machine);
2. the images `make images` built, loaded into the node (nothing is pulled: no registry);
3. `helm install` of the chart: the operator runs as a pod from its image, as the chart's
   ServiceAccount, in a namespace that enforces Pod Security "restricted";
4. the tiny model (made here) as a read-only volume, and the CPU sample applied;
5. its status shown until Ready (real probes on real engines);
6. one chat completion through the router's Service (its ClusterIP, through kube-proxy), the KV that
   decode loaded instead of computing, and a command to try another.
`make demo-down` (python -m e2e.demo down) deletes the sample, uninstalls, and stops the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dllm_operator import rollout
from e2e import models_volume, node_images
from e2e.cluster import controlplane as cp
from e2e.dataplane import kv_moved
from e2e.dataplane.pipeline import DEMO_CHAT, http_status, post_json

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "dllm-operator"
VALUES = ROOT / "e2e" / "demo-values.yaml"
SAMPLE = ROOT / "crds" / "samples" / "cpu-tiny.yaml"
SYSTEM_NAMESPACE = "dllm-system"
RELEASE = "dllm"
NAME = "tiny-cpu"
_PAUSE = threading.Event()  # never set: wait(t) is an interruptible pause


class DemoError(RuntimeError):
    pass


def step(message: str, started: float) -> None:
    print(f"\n==> [{time.monotonic() - started:5.1f}s] {message}", flush=True)


def tool(layout: cp.Layout, name: str, *args: str, stdin: str | None = None, check: bool = True) -> str:
    """kubectl or helm (the pinned ones) against the local cluster; a failure is a DemoError."""
    result = subprocess.run(
        [str(layout.tools_bin / name), f"--kubeconfig={layout.kubeconfig}", *args],
        input=stdin, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise DemoError(f"{name} {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def kubectl_json(layout: cp.Layout, *args: str) -> Any:
    return json.loads(tool(layout, "kubectl", "get", *args, "-o", "json"))


def install_chart(layout: cp.Layout) -> None:
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": SYSTEM_NAMESPACE,
            "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
        },
    }
    tool(layout, "kubectl", "apply", "--server-side", "-f", "-", stdin=json.dumps(namespace))
    tool(layout, "helm", "upgrade", "--install", RELEASE, str(CHART), "-n", SYSTEM_NAMESPACE,
         "-f", str(VALUES), "--wait", "--timeout=180s")  # fmt: skip
    tool(layout, "kubectl", "wait", "--for=condition=Established", "crd/disaggregatedllms.disagg.dev")


def describe(cr: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    status = cr.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    ready = conditions.get("Ready", {})
    counts = ", ".join(
        f"{role} {status.get(role, {}).get('ready', '-')}" for role in ("prefill", "decode", "router")
    )
    states = []
    for pod in pods:
        waiting = [s["state"]["waiting"]["reason"] for s in pod["status"].get("containerStatuses", [])
                   if "waiting" in s.get("state", {})]  # fmt: skip
        states.append(f"{pod['metadata']['name']}={waiting[0] if waiting else pod['status'].get('phase')}")
    return (
        f"{counts}, Ready={ready.get('status', '?')} ({ready.get('reason', 'waiting')}); {' '.join(states)}"
    )


def wait_ready(layout: cp.Layout, namespace: str, timeout: float) -> None:
    deadline, last = time.monotonic() + timeout, ""
    while True:
        cr = kubectl_json(layout, "dllm", NAME, "-n", namespace)
        pods = kubectl_json(layout, "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={NAME}")[
            "items"
        ]
        line = describe(cr, pods)
        if line != last:
            print(f"    {line}", flush=True)
            last = line
        if "Ready=True" in line:
            return
        if time.monotonic() > deadline:
            raise DemoError(f"{NAME} not Ready after {timeout:.0f}s: {line}")
        _PAUSE.wait(1.0)


# The operator reads the router's KV check every 15 s (the chart's kvCheck.pollSeconds); the router
# checks a new pair at once, in a second or two on this host.
KV_CHECK_WAIT_S = 120


def wait_kv_verified(layout: cp.Layout, namespace: str) -> dict[str, Any]:
    """The CR's KVTransferVerified condition once it says Verified; a DemoError for any other verdict
    that stays, or none within KV_CHECK_WAIT_S."""
    deadline, condition = time.monotonic() + KV_CHECK_WAIT_S, dict[str, Any]()
    while time.monotonic() < deadline:
        cr = kubectl_json(layout, "dllm", NAME, "-n", namespace)
        found = [c for c in cr.get("status", {}).get("conditions", []) if c["type"] == "KVTransferVerified"]
        condition = found[0] if found else {}
        if condition.get("reason") == "Verified":
            return condition
        _PAUSE.wait(1.0)
    raise DemoError(f"KVTransferVerified is not Verified after {KV_CHECK_WAIT_S}s: {condition}")


def answers(url: str) -> bool:
    return http_status(url) == 200


def ask(layout: cp.Layout, namespace: str, model: Path) -> dict[str, Any]:
    """One chat completion through the router Service; what decode loaded, from its own counters."""
    service = kubectl_json(layout, "service", f"{NAME}-router", "-n", namespace)
    router = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    # The router answers 503 until its own checks have seen a ready engine of each role.
    deadline = time.monotonic() + 60
    while not answers(f"{router}/ready"):
        if time.monotonic() > deadline:
            raise DemoError(f"{router}/ready did not answer 200 within 60s")
        _PAUSE.wait(0.5)
    decode_pod = engine_pod_name(layout, namespace, "decode")
    decode_ip = kubectl_json(layout, "pod", decode_pod, "-n", namespace)["status"]["podIP"]
    decode = f"http://{decode_ip}:{8000}"
    before = kv_moved.at(decode, router)
    status, body = post_json(f"{router}/v1/chat/completions", DEMO_CHAT)
    if status != 200:
        logs = engine_logs(layout, namespace)
        raise DemoError(f"the router answered {status}: {json.dumps(body)[:500]}\n{logs}")
    want = kv_moved.for_sample(model, [int(body["usage"]["prompt_tokens"])])
    try:
        got = kv_moved.wait_for(decode, before, want, router_url=router)
    except kv_moved.NotMoved as error:
        raise DemoError(f"{error}\n{engine_logs(layout, namespace)}") from None
    return {"router": router, "body": body, "moved": got}


# Lines every engine prints by the dozen that never explain an error: its route table and the
# probes' and scrapes' access lines.
_LOG_NOISE = ("Route: ", '"GET /health ', '"GET /metrics ')


def engine_pod_name(layout: cp.Layout, namespace: str, role: str, place: int = 0) -> str:
    """The name of the role's pod at `place` in its StatefulSet's window of ordinals: a rollout moves
    the window up (each new pod gets a new name), so the first pod is not always `-0`."""
    sts = kubectl_json(layout, "statefulset", f"{NAME}-{role}", "-n", namespace)
    return f"{NAME}-{role}-{rollout.start_of(sts) + place}"


def engine_logs(layout: cp.Layout, namespace: str, lines: int = 25) -> str:
    """The last lines of each engine's log but the noise: what to read when an answer is an error."""
    parts = []
    for role in ("prefill", "decode"):
        try:
            pod = engine_pod_name(layout, namespace, role)
            text = tool(layout, "kubectl", "logs", pod, "-n", namespace, "--tail=1000")
            kept = [line for line in text.splitlines() if not any(noise in line for noise in _LOG_NOISE)]
            text = "\n".join(kept[-lines:])
        except DemoError as error:
            text = str(error)
        parts.append(f"--- {role} engine, last {lines} lines (no route table, probes or scrapes) ---\n{text}")
    return "\n".join(parts)


def show_answer(result: dict[str, Any]) -> None:
    body = result["body"]
    print(f"    question: {DEMO_CHAT['messages'][0]['content']}")
    answer = body["choices"][0]["message"]["content"]
    print(f"    answer:   {answer!r} (a tiny model trained here for a minute on a few chats)")
    got = result["moved"]
    print(f"    decode loaded {got.tokens:.0f} prompt tokens of KV from prefill instead of computing them:")
    print(f"    {got.kv_bytes:.0f} bytes of KV, {got.wire_bytes:.0f} bytes on the wire (connector's count)")
    print("\n    Try another (from this machine: the ClusterIP is routed to the node):")
    request = json.dumps({"model": DEMO_CHAT["model"], "max_tokens": 128, "stop": ["\n"],
                          "messages": [{"role": "user", "content": "Tell me about KV caches."}]})  # fmt: skip
    headers = "-H 'Content-Type: application/json'"
    print(f"    curl -s {result['router']}/v1/chat/completions {headers} -d '{request}'")


def deploy(layout: cp.Layout, namespace: str, timeout: float, started: float) -> Path:
    """Images on the node, the chart installed, the model's claim and the CPU sample Ready: the model."""
    step("the images built here, into the node's containerd (make images built them)", started)
    node_images.load_all(layout)
    step(
        f"helm install {RELEASE} charts/dllm-operator -f e2e/demo-values.yaml (restricted Pod Security)",
        started,
    )
    install_chart(layout)
    print(tool(layout, "kubectl", "get", "pods", "-n", SYSTEM_NAMESPACE, "-o", "wide").rstrip())
    step(f"the tiny model as the read-only claim '{models_volume.CLAIM}', then the CPU sample", started)
    model = models_volume.make_model()
    tool(layout, "kubectl", "create", "namespace", namespace, check=False)
    for manifest in models_volume.manifests(namespace):
        tool(layout, "kubectl", "apply", "--server-side", "-f", "-", stdin=json.dumps(manifest))
    tool(layout, "kubectl", "apply", "--server-side", "-n", namespace, "-f", str(SAMPLE))
    step(f"waiting until {NAME} is Ready (engines load the model, probes pass)", started)
    wait_ready(layout, namespace, timeout)
    return model


def undeploy(layout: cp.Layout, namespace: str) -> None:
    # The resource and its pods first: deleting the namespace at once would make the namespace
    # controller wait out the longest grace period (the router's, long enough for a stream) before it
    # looks again, even though idle pods end within seconds of their drain.
    if tool(layout, "kubectl", "get", "namespace", namespace, "--ignore-not-found", "-o", "name").strip():
        tool(layout, "kubectl", "delete", "dllm", "--all", "-n", namespace, "--timeout=180s")
        gone = ("--for=delete", "pod", "--all", "-n", namespace, "--timeout=180s")
        tool(layout, "kubectl", "wait", *gone, check=False)  # fails when there was no pod left
    tool(layout, "kubectl", "delete", "namespace", namespace, "--ignore-not-found", "--timeout=180s")
    tool(layout, "kubectl", "delete", "pv", models_volume.volume_name(namespace), "--ignore-not-found")
    tool(layout, "helm", "uninstall", RELEASE, "-n", SYSTEM_NAMESPACE, "--ignore-not-found", "--wait")


def up(namespace: str, timeout: float) -> None:
    started = time.monotonic()
    step("the local cluster: control plane, kwok GPU nodes, and the real node dllm-real-0", started)
    layout = cp.up()
    model = deploy(layout, namespace, timeout, started)
    print(tool(layout, "kubectl", "get", "dllm,pods,svc", "-n", namespace, "-o", "wide").rstrip())
    step("one chat completion through the router Service", started)
    show_answer(ask(layout, namespace, model))
    step("the router's KV check: a canary through each pair, proven by decode's own record", started)
    verified = wait_kv_verified(layout, namespace)
    print(f"    KVTransferVerified={verified['status']} ({verified['reason']}): {verified['message']}")
    print(tool(layout, "kubectl", "get", "dllm", NAME, "-n", namespace).rstrip())
    step('done. eval "$(make -s cluster-env)" gives you kubectl; make demo-down stops it all', started)


def down(namespace: str, keep_cluster: bool) -> None:
    layout = cp.Layout.from_env()
    if set(cp.running_components(layout)) >= set(cp.COMPONENTS):
        undeploy(layout, namespace)
    if not keep_cluster:
        cp.down()
    print("demo stopped", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo")
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--namespace", default=os.environ.get("DLLM_DEMO_NAMESPACE", "demo"))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--keep-cluster", action="store_true", help="down: leave the cluster running")
    args = parser.parse_args()
    try:
        if args.command == "up":
            up(args.namespace, args.timeout)
        else:
            down(args.namespace, args.keep_cluster)
    except (cp.ClusterError, DemoError) as error:
        print(f"demo: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
