"""NetworkPolicy is enforced on the real node (kube-router's firewall beside kube-proxy): hand-written
policies isolate pods of the probe image across namespaces and come into force within a bounded time,
and the firewall reads only what it watches. The operator's own policies on the CPU sample are tested
on test_node_serving.py's deployment of it (one deploy for both)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from typing import Any

import pytest
from e2e.cluster import controlplane as cp
from e2e.cluster import nodeconfig as nc
from e2e.cluster import nodehost, probepod
from e2e.fixtures import (
    BLOCKED,
    DIAL_SECONDS,
    Cluster,
    holds_for,
    pod_ready,
    probe_dial,
    start_probe_servers,
    wait_until,
)

pytestmark = [pytest.mark.k8s, pytest.mark.node]

TEAM = {"team": "a"}


def pod_ip(cluster: Cluster, pod: str, namespace: str) -> str:
    return str(cluster.get_json("pod", pod, "-n", namespace)["status"]["podIP"])


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
    cluster: Cluster, namespace: str, other_namespace: str, real_node: cp.Layout
) -> None:
    start_probe_servers(cluster, real_node, [("server", namespace, TEAM), ("friend", namespace, TEAM),
                                 ("loner", namespace, {}), ("stranger", other_namespace, TEAM)])  # fmt: skip
    target = f"{pod_ip(cluster, 'server', namespace)}:{probepod.PORT}"
    # Without a policy every pod reaches the server: what follows is the policy's doing.
    for pod, ns in (("friend", namespace), ("loner", namespace), ("stranger", other_namespace)):
        assert probe_dial(cluster, pod, ns, target) == {target: "open"}, pod

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
        assert probe_dial(cluster, pod, ns, target)[target] in BLOCKED, pod
        assert time.monotonic() - began < DIAL_SECONDS + 15, pod
    # The kubelet's probes come from the node, which the firewall always admits: the server stays Ready.
    assert not holds_for(lambda: not pod_ready(cluster, "server", namespace), 5)

    removed = time.monotonic()
    cluster.run("delete", "networkpolicy", "--all", "-n", namespace)
    wait_until(lambda: probe_dial(cluster, "stranger", other_namespace, target)[target] == "open", 60,
               "the stranger to reach the server again once the policies are gone")  # fmt: skip
    print(f"policies deleted -> the stranger connects again: {time.monotonic() - removed:.2f}s")


READS = (("watch", "networkpolicies"), ("list", "pods"), ("list", "namespaces"), ("get", "nodes"))
WRITES_AND_SECRETS = (
    ("get", "secrets"),
    ("list", "configmaps"),
    ("create", "pods"),
    ("update", "pods/status"),
    ("patch", "nodes"),
    ("delete", "networkpolicies"),
    ("create", "events"),
)


def test_the_firewall_reads_only_what_it_watches_and_listens_nowhere(
    cluster: Cluster, real_node: cp.Layout
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
    assert f"pid={cp.read_pid(real_node, 'kube-router')}," not in sockets, sockets
