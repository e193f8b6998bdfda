"""NetworkPolicy is enforced on the real node (kube-router's firewall beside kube-proxy): hand-written
policies isolate pods of the probe image across namespaces and come into force within a bounded time,
and the operator's own policies keep a pod of another namespace off every engine port (HTTP, the KV
side channel, Mooncake's range) while completions through the router's Service still succeed."""

from __future__ import annotations

import collections
import functools
import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e import demo, models_volume
from e2e.cluster import controlplane as cp
from e2e.cluster import node, nodehost, probepod
from e2e.cluster import nodeconfig as nc
from e2e.dataplane.pipeline import post_json
from e2e.fixtures import Cluster, holds_for, wait_until

from dllm_operator.render.netpol import MOONCAKE_BOOTSTRAP_PORT
from dllm_operator.render.ports import TRANSFER_PORTS_ENV

pytestmark = [pytest.mark.k8s, pytest.mark.node]

TEAM = {"team": "a"}
# Outcomes of `probe dial` that mean the connection was not made: kube-router REJECTs (an ICMP port
# unreachable, which the client sees at once as 'connection refused'); a DROP would be a timeout.
BLOCKED = ("refused", "timeout")
DIAL_SECONDS = 3


@pytest.fixture
def layout(cluster: Cluster) -> cp.Layout:
    if cluster.layout is None or not node.running(cluster.layout):
        pytest.skip("the real node is not running (needs root and `make cluster-build`; DLLM_CP_REAL_NODE)")
    return cluster.layout


def _fresh_namespace(cluster: Cluster, name: str) -> Iterator[str]:
    cluster.run("delete", "namespace", name, "--ignore-not-found", "--wait=true", "--timeout=120s")
    cluster.run("create", "namespace", name)
    wait_until(
        lambda: cluster.exists("serviceaccount", "default", "-n", name), 30, f"{name}'s ServiceAccount"
    )
    yield name
    cluster.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def other_namespace(cluster: Cluster, namespace: str) -> Iterator[str]:
    """A second fresh namespace beside the test's own."""
    yield from _fresh_namespace(cluster, f"{namespace}-other")


def ready(cluster: Cluster, pod: str, namespace: str) -> bool:
    conditions = cluster.get_json("pod", pod, "-n", namespace).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def start_pods(cluster: Cluster, layout: cp.Layout, pods: list[tuple[str, str, dict[str, str]]]) -> None:
    """Probe servers (name, namespace, labels) on the real node, all Ready."""
    image = node.probe_image(layout)
    for name, namespace, labels in pods:
        cluster.apply(probepod.server(name, namespace, image, labels))
    for name, namespace, _ in pods:
        wait_until(functools.partial(ready, cluster, name, namespace), 120, f"pod {namespace}/{name} Ready")


def pod_ip(cluster: Cluster, pod: str, namespace: str) -> str:
    return str(cluster.get_json("pod", pod, "-n", namespace)["status"]["podIP"])


def dial(cluster: Cluster, pod: str, namespace: str, *addrs: str) -> dict[str, str]:
    """`probe dial` from inside a pod: each address's outcome (open, refused, timeout, error ...)."""
    result = cluster.run(
        "exec", pod, "-n", namespace, "--", "/probe", "dial", str(DIAL_SECONDS), *addrs, timeout=300
    )
    outcomes = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.strip())
    assert set(outcomes) == set(addrs), result.stdout
    return outcomes


def ingress_policies(namespace: str) -> list[dict[str, Any]]:
    """Deny all ingress in the namespace, then admit pods labelled team=a from pods labelled team=a
    (a podSelector peer without namespaceSelector: of this namespace only)."""
    meta = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy"}
    deny = {**meta, "metadata": {"name": "default-deny-ingress", "namespace": namespace},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}  # fmt: skip
    allow = {**meta, "metadata": {"name": "allow-same-team", "namespace": namespace},
             "spec": {"podSelector": {"matchLabels": TEAM}, "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": {"matchLabels": TEAM}}]}]}}  # fmt: skip
    return [deny, allow]


class Watch:
    """`probe watch ADDR` running in a pod through kubectl exec: it reports the wall-clock time of its
    first open connection, then of the first one that fails (same kernel clock as this process)."""

    def __init__(self, cluster: Cluster, pod: str, namespace: str, addr: str, seconds: int) -> None:
        argv = [
            cluster.kubectl_path,
            "exec",
            pod,
            "-n",
            namespace,
            "--",
            "/probe",
            "watch",
            addr,
            str(seconds),
        ]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env()
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def next(self, timeout: float) -> list[str]:
        try:
            return self.lines.get(timeout=timeout).split()
        except queue.Empty:
            raise AssertionError(f"probe watch said nothing within {timeout:.0f}s") from None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def test_default_deny_then_allow_same_label_refuses_another_namespace_until_the_policy_goes(
    cluster: Cluster, namespace: str, other_namespace: str, layout: cp.Layout
) -> None:
    start_pods(cluster, layout, [("server", namespace, TEAM), ("friend", namespace, TEAM),
                                 ("loner", namespace, {}), ("stranger", other_namespace, TEAM)])  # fmt: skip
    target = f"{pod_ip(cluster, 'server', namespace)}:{probepod.PORT}"
    # Without a policy every pod reaches the server: what follows is the policy's doing.
    for pod, ns in (("friend", namespace), ("loner", namespace), ("stranger", other_namespace)):
        assert dial(cluster, pod, ns, target) == {target: "open"}, pod

    watch = Watch(cluster, "stranger", other_namespace, target, 120)
    try:
        assert watch.next(60)[0] == "open"
        created = time.time()
        for policy in ingress_policies(namespace):
            cluster.apply(policy)
        closed = watch.next(60)
    finally:
        watch.stop()
    assert closed[0] == "closed", closed
    assert closed[2] in BLOCKED, closed
    enforced_after = int(closed[1]) / 1e9 - created
    print(f"\npolicy created -> first refused connection from another namespace: {enforced_after:.2f}s")
    assert enforced_after < 30

    # The same label in the same namespace connects; the same label elsewhere, or no label, does not,
    # and is told so within a bounded time.
    body = cluster.run("exec", "friend", "-n", namespace, "--", "/probe", "get", f"http://{target}/", "10")
    assert body.stdout == "probe server\n"
    for pod, ns in (("stranger", other_namespace), ("loner", namespace)):
        began = time.monotonic()
        assert dial(cluster, pod, ns, target)[target] in BLOCKED, pod
        assert time.monotonic() - began < DIAL_SECONDS + 15, pod
    # The kubelet's probes come from the node, which the firewall always admits: the server stays Ready.
    assert not holds_for(lambda: not ready(cluster, "server", namespace), 5)

    removed = time.monotonic()
    cluster.run("delete", "networkpolicy", "--all", "-n", namespace)
    wait_until(lambda: dial(cluster, "stranger", other_namespace, target)[target] == "open", 60,
               "the stranger to reach the server again once the policies are gone")  # fmt: skip
    print(f"policies deleted -> the stranger connects again: {time.monotonic() - removed:.2f}s")


READS = (("watch", "networkpolicies"), ("list", "pods"), ("list", "namespaces"), ("get", "nodes"))
WRITES_AND_SECRETS = (
    ("get", "secrets"), ("list", "configmaps"), ("create", "pods"), ("update", "pods/status"),
    ("patch", "nodes"), ("delete", "networkpolicies"), ("create", "events"),
)  # fmt: skip


def test_the_firewall_reads_only_what_it_watches_and_listens_nowhere(
    cluster: Cluster, layout: cp.Layout
) -> None:
    """Its certificate's user may list and watch what its informers need, and write nothing; with its
    health and metrics ports off (its health server would also serve Go's pprof), it has no socket."""
    user = ("--as", nc.KUBE_ROUTER_USER)
    for verb, resource in READS:
        assert cluster.run("auth", "can-i", verb, resource, "-A", *user).stdout.strip() == "yes", (
            verb,
            resource,
        )
    for verb, resource in WRITES_AND_SECRETS:
        denied = cluster.run("auth", "can-i", verb, resource, "-A", *user, check=False)
        assert (denied.returncode, denied.stdout.strip()) == (1, "no"), (verb, resource)
    sockets = nodehost.in_netns("ss", "-ltunp").stdout
    assert "kube-router" not in sockets, sockets
    assert f"pid={cp.read_pid(layout, 'kube-router')}," not in sockets, sockets


# ---- the operator's policies, on the CPU sample ----------------------------------------------------

SAMPLE_NAMESPACE = "node-isolation"


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


def remove_sample(cluster: Cluster) -> None:
    """The CR first, its children with it, then the namespace and the model's PV, each waited for.
    Deleting the namespace at once would wait out the largest pod grace period there (the router's,
    630 s by default) before the namespace controller looks again, however soon the pods end; and a PV
    still terminating from a previous run would leave the next run's claim unbound (pods Pending)."""
    delete = ("delete", "dllm", "--all", "-n", SAMPLE_NAMESPACE, "--cascade=foreground", "--timeout=300s")
    cluster.run(*delete, "--ignore-not-found", check=False, timeout=330)
    wait_until(lambda: not cluster.exists("pods", "-n", SAMPLE_NAMESPACE), 300, "the sample's pods to end")
    cluster.run("delete", "namespace", SAMPLE_NAMESPACE, "--ignore-not-found", "--timeout=300s", timeout=330)
    pv = models_volume.volume_name(SAMPLE_NAMESPACE)
    cluster.run("delete", "pv", pv, "--ignore-not-found", "--timeout=120s", timeout=150)


@pytest.fixture(scope="module")
def sample(cluster: Cluster) -> Iterator[cp.Layout]:
    """The CPU sample deployed by the chart's operator, as make demo does; the chart is uninstalled
    afterwards only if this fixture installed it (another module may share it)."""
    layout = cp.Layout.from_env()
    if not node.running(layout):
        pytest.fail(f"the real node is not running: {node.why_not(layout)}")
    installed = cluster.helm("status", demo.RELEASE, "-n", demo.SYSTEM_NAMESPACE, check=False).returncode == 0
    remove_sample(cluster)  # what an interrupted run left
    try:
        demo.deploy(layout, SAMPLE_NAMESPACE, 900, time.monotonic())
        yield layout
    finally:
        remove_sample(cluster)
        if not installed:
            cluster.helm(
                "uninstall", demo.RELEASE, "-n", demo.SYSTEM_NAMESPACE, "--ignore-not-found", "--wait"
            )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_pod_of_another_namespace_reaches_no_engine_port_while_the_router_serves(
    cluster: Cluster, sample: cp.Layout, other_namespace: str
) -> None:
    ns = SAMPLE_NAMESPACE
    policies = {p["metadata"]["name"] for p in cluster.get_json("networkpolicy", "-n", ns)["items"]}
    assert f"{demo.NAME}-engines" in policies, (
        f"the operator rendered no engines NetworkPolicy ({sorted(policies)}): is the image "
        "localhost/dllm/operator:dev older than the operator's NetworkPolicy rendering? (make images)"
    )
    start_pods(cluster, sample, [("stranger", other_namespace, {})])
    kv_listening: dict[str, list[int]] = {}
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        pod = cluster.get_json("pod", f"{demo.NAME}-{role}-0", "-n", ns)
        declared, transfer = engine_ports(pod)
        listening = listening_ports(cluster, pod["metadata"]["name"], ns)
        assert declared[0] == 8000, (role, declared)
        assert 8000 in listening, (role, sorted(listening))
        kv_ports = set(declared[1:]) | set(transfer) | {MOONCAKE_BOOTSTRAP_PORT}
        kv_listening[role] = sorted(listening & kv_ports)
        ip = pod["status"]["podIP"]
        # The other engine of this CR reaches every port that listens: they are reachable at all.
        peer_pod = f"{demo.NAME}-{peer}-0"
        from_peer = connect_from_engine(cluster, peer_pod, ns, [f"{ip}:{p}" for p in sorted(listening)])
        assert set(from_peer.values()) == {"open"}, (role, from_peer)
        # A pod of another namespace reaches none of them, nor any port the CR declares: HTTP, the side
        # channel, Mooncake's bootstrap and its whole transfer range.
        ports = sorted(listening | set(declared) | set(transfer) | {MOONCAKE_BOOTSTRAP_PORT})
        outcomes = dial(cluster, "stranger", other_namespace, *[f"{ip}:{p}" for p in ports])
        assert all(outcome in BLOCKED for outcome in outcomes.values()), (role, outcomes)
        print(f"\n{role}: listening {sorted(listening)}; from another namespace {len(ports)} ports tried, "
              f"{sorted(collections.Counter(outcomes.values()).items())}")  # fmt: skip
    # The KV path was among what was tried: some KV port listened (the side channel, Mooncake's).
    assert any(kv_listening.values()), kv_listening

    service = cluster.get_json("service", f"{demo.NAME}-router", "-n", ns)
    router = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
    wait_until(lambda: demo.answers(router + "/ready"), 120, "the router's /ready")
    body = {"model": "tiny-llama", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    status, answer = post_json(router + "/v1/completions", body, timeout=600)
    assert status == 200, answer
    assert len(answer["choices"]) == 1, answer
