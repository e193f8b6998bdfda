"""The local control plane behaves like a real cluster: controllers, scheduler, GC, RBAC, Pod Security,
audit log, restarts and a clean teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.cluster import controlplane as cp
from e2e.fixtures import Cluster, wait_until
from e2e.ports import free_consecutive_ports

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]


def statefulset(name: str, namespace: str, replicas: int, gpus: int) -> dict[str, object]:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{
                "name": "c", "image": "registry.example/none:1",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}},
        },
    }  # fmt: skip


def test_apiserver_ready_and_controllers_running(cluster: Cluster) -> None:
    assert cluster.run("get", "--raw=/readyz").stdout.strip() == "ok"
    # The token controller (controller-manager) made the default ServiceAccount.
    assert cluster.exists("serviceaccount", "default", "-n", "kube-system")
    # kwok's fake GPU nodes; the real node (dllm.dev/node=real) has no GPU.
    nodes = [n for n in cluster.get_json("nodes")["items"] if n["metadata"]["labels"].get("type") == "kwok"]
    assert len(nodes) >= 2
    assert all(n["status"]["allocatable"]["nvidia.com/gpu"] == "8" for n in nodes)
    assert all(n["status"]["allocatable"][cp.RDMA_RESOURCE] for n in nodes)


def test_statefulset_pods_become_ready_with_stable_names(cluster: Cluster, namespace: str) -> None:
    cluster.apply(statefulset("web", namespace, replicas=2, gpus=4))

    def ready_names() -> list[str]:
        pods = cluster.get_json("pods", "-n", namespace)["items"]
        return sorted(
            p["metadata"]["name"]
            for p in pods
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        )

    assert wait_until(lambda: ready_names() == ["web-0", "web-1"], 60, "2 Ready pods")
    nodes = {
        cluster.get_json("pod", name, "-n", namespace)["spec"]["nodeName"] for name in ("web-0", "web-1")
    }
    assert nodes <= {"gpu-node-0", "gpu-node-1"}


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(cluster: Cluster, namespace: str) -> None:
    cluster.apply(statefulset("huge", namespace, replicas=1, gpus=16))

    def scheduling_message() -> str:
        pod = (
            cluster.get_json("pod", "huge-0", "-n", namespace)
            if cluster.exists("pod", "huge-0", "-n", namespace)
            else {}
        )
        conditions = pod.get("status", {}).get("conditions", [])
        return next(
            (
                c.get("message", "")
                for c in conditions
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
            ),
            "",
        )

    message = wait_until(scheduling_message, 60, "PodScheduled=False")
    assert "Insufficient nvidia.com/gpu" in message
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=huge-0")
    assert any(e["reason"] == "FailedScheduling" for e in events["items"])
    assert cluster.get_json("pod", "huge-0", "-n", namespace)["status"]["phase"] == "Pending"


def test_garbage_collector_deletes_dependents(cluster: Cluster, namespace: str) -> None:
    cluster.run("create", "configmap", "owner", "-n", namespace)
    uid = cluster.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "dependent",
                "namespace": namespace,
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
            },
        }
    )
    cluster.run("delete", "configmap", "owner", "-n", namespace)
    wait_until(
        lambda: not cluster.exists("configmap", "dependent", "-n", namespace),
        90,
        "the garbage collector to delete the dependent",
    )


def test_rbac_denies_a_bare_service_account(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    cluster.run("create", "serviceaccount", "nobody", "-n", namespace)
    token = cluster.run("create", "token", "nobody", "-n", namespace, "--duration=10m").stdout.strip()
    assert token.count(".") == 2  # a signed JWT from the TokenRequest API
    denied = cluster.as_token(token, tmp_path / "kubeconfig", "get", "pods", "-n", namespace)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr
    assert f"system:serviceaccount:{namespace}:nobody" in denied.stderr


def test_pod_security_admission_refuses_privileged_pod(cluster: Cluster, namespace: str) -> None:
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "x", "securityContext": {"privileged": True}}]},
    }
    refused = cluster.run("apply", "-f", "-", input_text=json.dumps(pod), check=False)
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted' in refused.stderr
    assert "privileged" in refused.stderr
    assert not cluster.exists("pod", "root", "-n", namespace)


def test_audit_log_records_writes(cluster: Cluster, namespace: str) -> None:
    cluster.run("create", "configmap", "audited", "-n", namespace)

    def logged() -> bool:
        return any(
            e.get("verb") == "create"
            and e.get("objectRef", {}).get("name") == "audited"
            and e.get("objectRef", {}).get("namespace") == namespace
            for e in cluster.audit_entries()
        )

    wait_until(logged, 10, "the audit log entry of the create")


def test_apiserver_restart_keeps_the_data(cluster: Cluster, namespace: str) -> None:
    if cluster.layout is None:
        pytest.skip("restarting components only works on the local control plane")
    cluster.run("create", "configmap", "survivor", "-n", namespace)
    cp.restart_component(cluster.layout, "kube-apiserver")
    assert cluster.run("get", "--raw=/readyz").stdout.strip() == "ok"
    assert cluster.exists("configmap", "survivor", "-n", namespace)


def _run_cluster_cli(state: Path, port_base: int, *args: str) -> subprocess.CompletedProcess[str]:
    # no real node: the machine's one belongs to the first cluster (make test asks for it with =1)
    env = dict(os.environ, DLLM_CP_STATE=str(state), DLLM_CP_PORT_BASE=str(port_base), DLLM_CP_REAL_NODE="0")
    return subprocess.run(
        [sys.executable, "-m", "e2e.cluster", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_second_cluster_lifecycle_reuse_stale_and_clean_teardown(tmp_path: Path) -> None:
    """A separate cluster on ports of its own: up twice (reused), its API server SIGKILLed (a stale
    cluster: the other components still run), up (the survivors replaced), down (no process, no port)."""
    state = tmp_path / "cp"
    probe = cp.Layout(cp.Layout.from_env().cache, state, 0, cp.read_versions())
    base = free_consecutive_ports(len(probe.ports))
    layout = cp.Layout(probe.cache, state, base, probe.versions)
    pids: list[int] = []
    try:
        assert _run_cluster_cli(state, base, "up", "--nodes", "1").returncode == 0
        again = _run_cluster_cli(state, base, "up", "--nodes", "1")
        assert again.returncode == 0
        assert "reusing" in again.stderr
        cp.kill_component(layout, "kube-apiserver")
        survivors = [c for c in cp.COMPONENTS if c != "kube-apiserver"]
        assert cp.running_components(layout) == survivors
        stale = [pid for c in survivors if (pid := cp.read_pid(layout, c)) is not None]
        revived = _run_cluster_cli(state, base, "up", "--nodes", "1")
        assert revived.returncode == 0, revived.stderr
        assert f"stale cluster ({', '.join(survivors)} still alive): stopping it first" in revived.stderr
        assert [pid for pid in stale if cp.pid_alive(pid)] == []
        assert cp.running_components(layout) == list(cp.COMPONENTS)
        pids = [pid for c in cp.COMPONENTS if (pid := cp.read_pid(layout, c)) is not None]
    finally:
        down = _run_cluster_cli(state, base, "down")
    assert down.returncode == 0, down.stderr
    assert [pid for pid in pids if cp.pid_alive(pid)] == []
    assert [p for p in layout.ports.values() if cp.port_in_use(p)] == []
    assert not state.exists()


def test_cluster_env_prints_exports_without_a_cluster(tmp_path: Path) -> None:
    result = _run_cluster_cli(tmp_path / "nothing-here", 28400, "env")
    assert result.returncode == 0
    assert f'export KUBECONFIG="{tmp_path / "nothing-here" / "kubeconfig"}"' in result.stdout
    assert "tools-kubectl-v1.36.3-helm-v4.2.3" in result.stdout
