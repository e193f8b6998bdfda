"""The engines' pods on a real cluster (H7): Pod Security "restricted" admits them (with a role's
securityContext overrides too, never as root), "baseline" admits RDMA engines only without IPC_LOCK, and
their NetworkPolicies and Secret references follow spec.security."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dllm_cases import UNPRIVILEGED, merged, minimal
from e2e.fixtures import Cluster, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import cpu_sample_on_kwok
from k8s_dry_run import create

from dllm_operator.api import parse
from dllm_operator.render import render_all

pytestmark = pytest.mark.k8s


def test_security_context_overrides_meet_pod_security_restricted(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """A role's runAsUser, runAsGroup, fsGroup and Localhost seccomp profile keep its pods within
    "restricted"; the same pod as root (what the CR cannot ask) is refused."""
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    patch = dict(UNPRIVILEGED)["security-context"]
    body = merged(merged(minimal("ids"), {"metadata": {"namespace": namespace, "uid": "u"}}), {"spec": patch})
    sts = next(
        m
        for m in render_all(parse(body))
        if m["metadata"]["name"] == "ids-decode" and m["kind"] == "StatefulSet"
    )
    template = sts["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "ids"},
        "spec": template["spec"],
    }
    result = create(cluster, namespace, pod)
    assert result.returncode == 0, result.stderr
    as_root = merged(pod, {"spec": {"securityContext": {"runAsUser": 0}}})
    assert "runAsUser=0" in create(cluster, namespace, as_root).stderr


def test_engine_pods_meet_pod_security_restricted(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    """The operator reconciles the CPU sample in a namespace enforcing "restricted": the StatefulSets'
    and the Deployment's controllers create every pod (no FailedCreate), beside the resource's
    NetworkPolicies and auth Secret."""
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    operator = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace).start()
    try:
        cluster.apply(cpu_sample_on_kwok(), "-n", namespace)

        def pods() -> set[str]:
            selector = "app.kubernetes.io/instance=tiny-cpu"
            items = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
            return {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in items}

        def failed_creates() -> list[str]:
            events = cluster.get_json("events", "-n", namespace)["items"]
            return [e["message"] for e in events if e["reason"] == "FailedCreate"]

        wait_until(
            lambda: pods() == {"prefill", "decode", "router"} or failed_creates(),
            90,
            f"the pods (operator log: {operator.log_path})",
        )
        assert failed_creates() == []
        policies = cluster.get_json("networkpolicies", "-n", namespace)["items"]
        assert sorted(p["metadata"]["name"] for p in policies) == ["tiny-cpu-engines", "tiny-cpu-router"]
        assert cluster.exists("secret", "tiny-cpu-dllm-auth", "-n", namespace)
    finally:
        operator.stop()


def test_rdma_device_plugin_engines_meet_baseline_without_ipc_lock(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """IPC_LOCK is outside Pod Security "baseline": with rdma.ipcLock false (memlock from the runtime) the
    engines run as the non-root user and a baseline namespace admits them; with it, it refuses them."""
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    for ipc_lock, admitted in ((False, True), (True, False)):
        body = merged(minimal("rdma"), {"metadata": {"namespace": namespace, "uid": "u"}})
        body = merged(body, {"spec": {"rdma": {"enabled": True, "ipcLock": ipc_lock}}})
        sts = next(m for m in render_all(parse(body)) if m["kind"] == "StatefulSet")
        template = sts["spec"]["template"]
        metadata = {**template["metadata"], "name": "rdma-engine"}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
        result = create(cluster, namespace, pod)
        assert (result.returncode == 0) is admitted, (ipc_lock, result.stderr)
        if not admitted:
            assert "IPC_LOCK" in result.stderr


def test_turning_isolation_and_authentication_off_removes_them(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    """spec.security opts out: the operator deletes the NetworkPolicies it made, and the pods lose their
    secret references (the Secret itself stays until the resource goes; the operator cannot delete it)."""
    operator = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace).start()
    try:
        cluster.apply(cpu_sample_on_kwok(), "-n", namespace)

        def policies() -> list[str]:
            items = cluster.get_json("networkpolicies", "-n", namespace)["items"]
            return sorted(p["metadata"]["name"] for p in items)

        def secret_refs() -> set[str]:
            sts = cluster.get_json("statefulset", "tiny-cpu-decode", "-n", namespace, "--ignore-not-found")
            containers = sts.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])
            return {
                e["name"] for e in containers[0].get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
            }

        wait_until(lambda: policies() == ["tiny-cpu-engines", "tiny-cpu-router"], 60, "the NetworkPolicies")
        wait_until(lambda: secret_refs() == {"DLLM_KV_AUTH_TOKEN", "VLLM_API_KEY"}, 60, "the secret refs")
        off = {"spec": {"security": {"networkPolicy": False, "authentication": False}}}
        cluster.run("patch", "dllm", "tiny-cpu", "-n", namespace, "--type=merge", "-p", json.dumps(off))
        wait_until(lambda: policies() == [], 60, f"the NetworkPolicies pruned ({operator.log_path})")
        wait_until(lambda: secret_refs() == set(), 60, "no secret refs")
    finally:
        operator.stop()
