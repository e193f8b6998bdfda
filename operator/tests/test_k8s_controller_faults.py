"""The controller keeps its promises under faults, on the real local control plane (review M3, M5):
a watch gap that hid deletions is repaired by the resync, replacing a StatefulSet whose immutable
field changed keeps its pods running, and a child the API server refuses shows in the status."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from dllm_cases import ROOT, load_cr, merged
from e2e.fixtures import Cluster, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import on_kwok_nodes

from dllm_operator.config import OperatorConfig
from dllm_operator.controller import Controller
from dllm_operator.kube import KubeClient, load_credentials

pytestmark = pytest.mark.k8s
CPU_SAMPLE = ROOT / "crds" / "samples" / "cpu-tiny.yaml"


def cpu_cr(name: str) -> dict[str, Any]:
    return merged(on_kwok_nodes(load_cr(CPU_SAMPLE)), {"metadata": {"name": name}})


@pytest.fixture
async def controller(cluster: Cluster, crd: str, namespace: str) -> AsyncIterator[Controller]:
    """An in-process controller with no watches: every deletion is one it missed."""
    client = KubeClient(load_credentials(str(cluster.kubeconfig)))
    yield Controller(client=client, config=OperatorConfig(namespaces=(namespace,)))
    await client.close()


async def test_resync_forgets_what_vanished_during_a_watch_gap(
    cluster: Cluster, namespace: str, controller: Controller
) -> None:
    for name in ("kept", "gone"):
        cluster.apply(cpu_cr(name), "-n", namespace)
    await controller.seed((namespace,))
    for name in ("kept", "gone"):
        await controller.reconcile((namespace, name))
    assert cluster.exists("statefulset", "kept-prefill", "-n", namespace)
    cluster.run("delete", "statefulset", "kept-prefill", "-n", namespace, "--wait=true")
    cluster.run("delete", "dllm", "gone", "-n", namespace, "--wait=true")

    await controller.relist()

    assert (namespace, "gone") not in controller.store.resources
    assert not controller.store.children.get((namespace, "gone"))
    await controller.reconcile((namespace, "kept"))
    assert cluster.exists("statefulset", "kept-prefill", "-n", namespace), "the missed deletion is repaired"


@pytest.fixture
def operator(cluster: Cluster, crd: str, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace).start()
    yield process
    process.stop()


def prefill_pods(cluster: Cluster, namespace: str) -> dict[str, str]:
    items = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=prefill")["items"]
    return {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in items}


def prefill_set(cluster: Cluster, namespace: str, ready: int) -> dict[str, Any] | None:
    found = cluster.run("get", "statefulset", "tiny-prefill", "-n", namespace, "-o", "json", check=False)
    if found.returncode != 0:
        return None
    sts: dict[str, Any] = json.loads(found.stdout)
    return sts if sts.get("status", {}).get("readyReplicas") == ready else None


def degraded(cluster: Cluster, namespace: str) -> dict[str, Any] | None:
    """The sample's Degraded condition while it is True, else None."""
    cr = cluster.get_json("dllm", "tiny", "-n", namespace)
    found = [c for c in cr.get("status", {}).get("conditions", []) if c["type"] == "Degraded"]
    return found[0] if found and found[0]["status"] == "True" else None


def test_replacing_a_statefulset_for_an_immutable_field_keeps_its_pods(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(merged(cpu_cr("tiny"), {"spec": {"prefill": {"replicas": 2}}}), "-n", namespace)
    sts = wait_until(lambda: prefill_set(cluster, namespace, ready=2), 120, "two ready prefill pods")
    pods = prefill_pods(cluster, namespace)
    assert len(pods) == 2
    # What an operator upgrade does: the StatefulSet in the cluster differs from the new rendering in a
    # field the API server will not update. Stand in for it, while the operator is down, with a copy
    # whose serviceName differs; then the operator starts again.
    operator.stop()
    cluster.run("delete", "statefulset", "tiny-prefill", "-n", namespace, "--cascade=orphan", "--wait=true")
    impostor = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "tiny-prefill", "namespace": namespace, "labels": sts["metadata"]["labels"]},
        "spec": {**sts["spec"], "serviceName": "not-the-rendered-one"},
    }
    cluster.apply(impostor)
    operator.start()

    def rendered_set_back() -> bool:
        # The replace deletes the impostor before it creates the rendered one: absent for a moment.
        found = cluster.run("get", "statefulset", "tiny-prefill", "-n", namespace, "--ignore-not-found",
                            "-o", "jsonpath={.spec.serviceName}").stdout  # fmt: skip
        return found == "tiny-prefill"

    wait_until(rendered_set_back, 120, "the operator's StatefulSet back in place")
    wait_until(lambda: prefill_set(cluster, namespace, ready=2), 120, "the new StatefulSet counting its pods")
    assert prefill_pods(cluster, namespace) == pods, "no pod was deleted or recreated"
    reasons = {e["reason"] for e in cluster.get_json("events", "-n", namespace)["items"]}
    assert "Replaced" in reasons


def test_pods_the_statefulset_cannot_create_show_in_the_status(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods", "namespace": namespace},
        "spec": {"hard": {"pods": "0"}},
    }
    cluster.apply(quota)
    cluster.apply(cpu_cr("tiny"), "-n", namespace)

    # Each workload's refusal reaches the status as its own Event or condition appears: the first
    # Degraded may name another workload than prefill's StatefulSet, so wait until it names that one.
    def prefill_refused() -> dict[str, Any] | None:
        condition = degraded(cluster, namespace)
        return condition if condition and "StatefulSet tiny-prefill" in condition["message"] else None

    condition = wait_until(prefill_refused, 90, "Degraded naming the prefill StatefulSet")
    assert condition["reason"] == "FailedCreate"
    assert "exceeded quota" in condition["message"]
    cluster.run("delete", "resourcequota", "no-pods", "-n", namespace)
    wait_until(lambda: degraded(cluster, namespace) is None, 120, "Degraded=False once pods can be created")


def test_a_child_the_api_server_refuses_shows_as_apply_failed_then_recovers(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """An affinity is passed through as written (the CRD keeps it free-form), so one the API server
    refuses in the StatefulSet is this resource's Degraded=ApplyFailed and a FailedApply Event, naming
    the child, and the rest is still applied; a fixed spec clears it."""
    bad = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "Maybe"}]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": bad}}
    cluster.apply(merged(cpu_cr("tiny"), {"spec": {"decode": {"affinity": affinity}}}), "-n", namespace)

    condition = wait_until(
        lambda: degraded(cluster, namespace), 90, "Degraded=True for the refused StatefulSet"
    )
    assert condition["reason"] == "ApplyFailed"
    assert "StatefulSet tiny-decode" in condition["message"]
    # The field and the reason, without the value the API server quoted (which may be a secret).
    assert "matchExpressions[0].operator: Invalid value: (redacted)" in condition["message"]
    assert "Maybe" not in condition["message"], condition["message"]

    def failed_apply() -> dict[str, Any] | None:  # Events are posted beside the status, not before it
        items = cluster.get_json("events", "-n", namespace)["items"]
        return next((e for e in items if e["reason"] == "FailedApply"), None)

    failed = wait_until(failed_apply, 30, "the FailedApply Event")
    assert failed["type"] == "Warning"
    assert "StatefulSet tiny-decode" in failed["message"]
    assert "Maybe" not in failed["message"]
    assert cluster.exists("statefulset", "tiny-prefill", "-n", namespace), "the rest was applied"
    assert not cluster.exists("statefulset", "tiny-decode", "-n", namespace)
    cluster.apply(cpu_cr("tiny"), "-n", namespace)
    wait_until(lambda: degraded(cluster, namespace) is None, 120, "Degraded=False once the spec is fixed")
    assert cluster.exists("statefulset", "tiny-decode", "-n", namespace)
