"""The real node of the local cluster: Ready with its label and taint beside the kwok nodes, pods get IPs
from the pod network, Services work through kube-proxy and CoreDNS, a pod's ServiceAccount token reaches
the API server, and `down` leaves nothing of the node on the machine, even after its daemons crashed."""

from __future__ import annotations

import fcntl
import ipaddress
import json
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e.cluster import controlplane as cp
from e2e.cluster import node, ociimage, probepod
from e2e.cluster import nodeconfig as nc
from e2e.cluster import nodehost as host
from e2e.fixtures import Cluster, holds_for, wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.node]
ROOT = Path(__file__).resolve().parents[2]


def probe_pod(name: str, namespace: str, args: list[str], layout: cp.Layout, **spec: Any) -> dict[str, Any]:
    return probepod.probe_pod(name, namespace, args, node.probe_image(layout), **spec)


def pod_status(cluster: Cluster, name: str, namespace: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get_json("pod", name, "-n", namespace).get("status", {})
    return status


def ready(cluster: Cluster, name: str, namespace: str) -> bool:
    conditions = pod_status(cluster, name, namespace).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def finished(cluster: Cluster, name: str, namespace: str) -> str:
    phase = str(pod_status(cluster, name, namespace).get("phase", ""))
    return phase if phase in ("Succeeded", "Failed") else ""


def http_get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:  # noqa: S310 (pod and Service IPs only)
            return str(response.read().decode())
    except OSError:
        return ""


def test_real_node_is_ready_with_its_label_and_taint_beside_the_kwok_nodes(
    cluster: Cluster, real_node: cp.Layout
) -> None:
    real = cluster.get_json("node", nc.NODE_NAME)
    assert real["metadata"]["labels"][nc.LABEL[0]] == nc.LABEL[1]
    assert {"key": nc.TAINT["key"], "value": "true", "effect": "NoSchedule"} in real["spec"]["taints"]
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in real["status"]["conditions"])
    assert {"type": "InternalIP", "address": nc.NODE_IP} in real["status"]["addresses"]
    assert real["status"]["nodeInfo"]["kubeletVersion"] == f"v{real_node.versions['K8S_VERSION']}"
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    for name, _ in cp.node_names(2):
        assert cluster.exists("node", name)


def test_pod_without_the_toleration_never_lands_on_the_real_node(cluster: Cluster, namespace: str) -> None:
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "intruder", "namespace": namespace},
        "spec": {"nodeSelector": dict([nc.LABEL]), "containers": [{"name": "c", "image": "none.invalid/x"}]},
    }  # fmt: skip
    cluster.apply(pod)

    def unschedulable() -> str:
        conditions = pod_status(cluster, "intruder", namespace).get("conditions", [])
        return next((c.get("message", "") for c in conditions if c.get("reason") == "Unschedulable"), "")

    assert "1 node(s) had untolerated taint" in wait_until(unschedulable, 60, "the pod to be Unschedulable")
    assert not cluster.get_json("pod", "intruder", "-n", namespace)["spec"].get("nodeName")


def test_pod_runs_on_the_real_node_with_an_ip_from_the_pod_network(
    cluster: Cluster, namespace: str, real_node: cp.Layout
) -> None:
    cluster.apply(probe_pod("server", namespace, ["serve", ":8080"], real_node))
    wait_until(lambda: ready(cluster, "server", namespace), 90, "the probe server pod to be Ready")
    pod = cluster.get_json("pod", "server", "-n", namespace)
    assert pod["spec"]["nodeName"] == nc.NODE_NAME
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(nc.POD_CIDR)
    # The host reaches the pod through its route via the node's veth.
    assert wait_until(
        lambda: http_get(f"http://{pod['status']['podIP']}:8080/"), 30, "HTTP from the host"
    ) == ("probe server\n")
    assert "serving on :8080" in cluster.run("logs", "server", "-n", namespace).stdout


def test_service_reached_by_cluster_ip_and_by_name_through_coredns(
    cluster: Cluster, namespace: str, real_node: cp.Layout
) -> None:
    cluster.apply(probe_pod("web", namespace, ["serve", ":8080"], real_node))
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": namespace},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }  # fmt: skip
    cluster.apply(service)
    wait_until(lambda: ready(cluster, "web", namespace), 90, "the web pod to be Ready")
    cluster_ip = cluster.get_json("service", "web", "-n", namespace)["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(nc.SERVICE_CIDR)
    # From the host, through the route to the node and kube-proxy's DNAT there.
    assert wait_until(lambda: http_get(f"http://{cluster_ip}/"), 60, "HTTP to the ClusterIP") == "probe web\n"
    # From a pod, by name: CoreDNS answers, kube-proxy forwards.
    url = f"http://web.{namespace}.svc.cluster.local/"
    cluster.apply(probe_pod("client", namespace, ["get", url, "60"], real_node, restartPolicy="Never"))
    assert (
        wait_until(lambda: finished(cluster, "client", namespace), 120, "the client pod to finish")
        == "Succeeded"
    )
    assert cluster.run("logs", "client", "-n", namespace).stdout == "probe web\n"
    short = probe_pod("short", namespace, ["get", "http://web/", "60"], real_node, restartPolicy="Never")
    cluster.apply(short)  # the namespace's search domain
    assert wait_until(lambda: finished(cluster, "short", namespace), 120, "the short-name pod") == "Succeeded"


def test_pod_calls_the_api_server_with_its_service_account_token(
    cluster: Cluster, namespace: str, real_node: cp.Layout
) -> None:
    cluster.apply(probe_pod("whoami", namespace, ["whoami", "60"], real_node, restartPolicy="Never"))
    assert wait_until(lambda: finished(cluster, "whoami", namespace), 120, "the whoami pod") == "Succeeded"
    review = json.loads(cluster.run("logs", "whoami", "-n", namespace).stdout)
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:default"


def test_load_image_streams_an_archive_from_stdin(
    cluster: Cluster, namespace: str, real_node: cp.Layout, tmp_path: Path
) -> None:
    """An archive made here (the probe program under a new name) goes in through the CLI's stdin."""
    with tarfile.open(node.Binaries(real_node).images / "probe.tar") as archive:
        layer = max(archive.getmembers(), key=lambda m: m.size)
        with tarfile.open(fileobj=archive.extractfile(layer)) as files:
            (tmp_path / "probe").write_bytes(files.extractfile("probe").read())  # type: ignore[union-attr]
    name = f"localhost/dllm-test/loaded:{namespace[-8:]}"
    ociimage.write_image(tmp_path / "image.tar", name, [(tmp_path / "probe", "probe")], ["/probe"])
    with (tmp_path / "image.tar").open("rb") as stdin:
        loaded = subprocess.run(
            [sys.executable, "-m", "e2e.cluster", "load-image", "-"],
            stdin=stdin, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    assert name in node.ctr(real_node, "images", "ls", "-q")
    pod = probe_pod("loaded", namespace, ["serve", ":8080"], real_node)
    pod["spec"]["containers"][0]["image"] = name
    cluster.apply(pod)
    wait_until(lambda: ready(cluster, "loaded", namespace), 90, "the pod of the loaded image to be Ready")
    ip = cluster.get_json("pod", "loaded", "-n", namespace)["status"]["podIP"]
    assert wait_until(lambda: http_get(f"http://{ip}:8080/"), 30, "HTTP from the host") == "probe loaded\n"
    node.ctr(real_node, "images", "rm", name)


def test_an_up_waits_while_another_up_or_down_holds_the_cluster(real_node: cp.Layout) -> None:
    """Test sessions started together each call up(): the second waits for the first, then reuses the
    cluster, instead of tearing down a half-started one (kube-router and the kubelet died that way)."""
    with open(f"{real_node.state}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = subprocess.Popen(
            [sys.executable, "-m", "e2e.cluster", "up"], cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        try:
            assert not holds_for(lambda: waiting.poll() is not None, 3, interval=0.2)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _, stderr = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, stderr
    assert "already running" in stderr
    assert "real node dllm-real-0 already running: reusing it" in stderr


def leftovers(real_node: cp.Layout) -> list[str]:
    found = [f"netns {host.NETNS_PATH}"] if host.NETNS_PATH.exists() else []
    found += [f"link {link}" for link in (nc.HOST_VETH, nc.BRIDGE) if host.link_exists(link)]
    routes = host.run("ip", "route", "show").stdout
    found += [f"route {cidr}" for cidr in host.HOST_ROUTES if cidr in routes]
    node_root = str(real_node.state / "node")
    found += [
        f"mount {p}" for p, _ in host.mountinfo() if p.startswith(node_root) or p == str(host.NETNS_PATH)
    ]
    found += [f"cgroup {root}" for root in host.cgroup_roots() if root.exists()]
    rules = host.run("iptables-save").stdout
    found += [f"iptables {line}" for line in rules.splitlines() if "KUBE-" in line or nc.POD_CIDR in line]
    # kube-router's ipsets and rules live in the node's namespace: none may show on the host.
    found += [f"ipset {name}" for name in host.run("ipset", "list", "-n").stdout.split() if "KUBE-" in name]
    if shutil.which("nft"):
        found += [f"nft {line.strip()}" for line in host.run("nft", "list", "ruleset").stdout.splitlines()
                  if "KUBE-" in line or nc.POD_CIDR in line]  # fmt: skip
    binaries = node.Binaries(real_node)
    exes = [binaries.containerd / b for b in ("containerd", "containerd-shim-runc-v2")]
    exes += [binaries.kubelet, binaries.kube_proxy, binaries.kube_router, Path(nc.RUNC)]
    found += [f"process {pid}" for pid in host.pids_running(exes)]
    found += [
        f"component {c}" for c in node.COMPONENTS if (p := cp.read_pid(real_node, c)) and cp.pid_alive(p)
    ]
    return found


@pytest.mark.slow
def test_down_after_a_crash_leaves_nothing_then_up_again(
    cluster: Cluster, namespace: str, real_node: cp.Layout
) -> None:
    """Runs last: SIGKILLs the node's daemons with a pod running under a NetworkPolicy (so kube-router
    made its chains and ipsets), tears down, checks, starts it again."""
    cluster.apply(probe_pod("victim", namespace, ["serve", ":8080"], real_node))
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "victim-only-from-victims", "namespace": namespace},
        "spec": {"podSelector": {"matchLabels": {"app": "victim"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "victim"}}}]}]},
    }  # fmt: skip
    cluster.apply(policy)
    wait_until(lambda: ready(cluster, "victim", namespace), 90, "the victim pod to be Ready")

    def firewall_in_node() -> bool:
        sets = host.in_netns("ipset", "list", "-n").stdout
        return "KUBE-POD-FW-" in host.in_netns("iptables-save").stdout and "KUBE-" in sets

    wait_until(firewall_in_node, 60, "kube-router's pod chain and ipsets in the node's namespace")
    in_node = host.in_netns("iptables-save").stdout
    assert "KUBE-SERVICES" in in_node  # kube-proxy's rules live in the node's namespace only
    node.kill_for_test(real_node)
    node.down(real_node)
    assert leftovers(real_node) == []
    node.ensure(real_node, time.monotonic())
    assert node.node_ready(real_node)
