"""The operator on the real local control plane: convergence, scaling, drift repair, truthful status,
crash and API-server restarts, deletion, leader election and quiet idling."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from dllm_cases import ROOT, load_cr, merged
from e2e.fixtures import Cluster, holds_for, operator_writes, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import on_kwok_nodes

from dllm_operator.render import HASH_ANNOTATION

pytestmark = pytest.mark.k8s
CPU_SAMPLE = ROOT / "crds" / "samples" / "cpu-tiny.yaml"


def cpu_cr(name: str = "tiny-cpu", **spec: Any) -> dict[str, Any]:
    return merged(on_kwok_nodes(load_cr(CPU_SAMPLE)), {"metadata": {"name": name}, "spec": spec})


def condition(cr: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in cr.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def get_cr(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get_json("dllm", name, "-n", namespace)


def wait_condition(
    cluster: Cluster, namespace: str, name: str, kind: str, status: str, timeout: float = 60
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cr = get_cr(cluster, namespace, name)
        current = condition(cr, kind)
        fresh = current.get("observedGeneration") == cr["metadata"]["generation"]
        return cr if current.get("status") == status and fresh else None

    return wait_until(check, timeout, f"{name} {kind}={status}")  # type: ignore[no-any-return]


def children(cluster: Cluster, namespace: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for kind in ("statefulsets", "deployments", "services", "poddisruptionbudgets"):
        items = cluster.get_json(kind, "-n", namespace)["items"]
        found[kind] = sorted(i["metadata"]["name"] for i in items)
    return found


def pod_uids(cluster: Cluster, namespace: str, component: str) -> dict[str, str]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", f"app.kubernetes.io/component={component}")[
        "items"
    ]
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}


def test_cpu_sample_converges_to_ready(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]
    assert (cr["status"]["prefill"]["ready"], cr["status"]["decode"]["ready"]) == ("1/1", "1/1")
    assert cr["status"]["endpoint"] == f"http://tiny-cpu-router.{namespace}.svc:8000"
    assert children(cluster, namespace) == {
        "statefulsets": ["tiny-cpu-decode", "tiny-cpu-prefill"],
        "deployments": ["tiny-cpu-router"],
        "services": ["tiny-cpu-decode", "tiny-cpu-prefill", "tiny-cpu-router"],
        "poddisruptionbudgets": [],
    }
    row = cluster.run("get", "dllm", "tiny-cpu", "-n", namespace, "--no-headers").stdout.split()
    assert row[:5] == ["tiny-cpu", "1/1", "1/1", "True", "mooncake"]
    events = cluster.get_json(
        "events", "-n", namespace, "--field-selector", "involvedObject.kind=DisaggregatedLLM"
    )
    created = " ".join(e["message"] for e in events["items"] if e["reason"] == "Created")
    for child in (
        "StatefulSet tiny-cpu-prefill",
        "StatefulSet tiny-cpu-decode",
        "Deployment tiny-cpu-router",
    ):
        assert child in created, created
    for kind in ("Ready", "PrefillReady", "DecodeReady", "RouterReady"):
        assert condition(cr, kind)["status"] == "True"
    assert condition(cr, "Degraded")["status"] == "False"
    # What /metrics shows an operator of the operator: the one resource, and each reconcile timed.
    assert operator.metric("dllm_operator_managed_resources") == 1.0
    assert operator.metric("dllm_operator_reconciles_total") >= 1
    assert operator.metric("dllm_operator_reconcile_duration_seconds_count") >= 1
    assert operator.metric("dllm_operator_reconcile_duration_seconds_sum") > 0


def test_scale_decode_leaves_prefill_alone(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    prefill_generation = cluster.get_json("sts", "tiny-cpu-prefill", "-n", namespace)["metadata"][
        "generation"
    ]
    prefill_pods = pod_uids(cluster, namespace, "prefill")
    for replicas in (3, 1):
        cluster.run("scale", "dllm/tiny-cpu", "-n", namespace, f"--replicas={replicas}")
        cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
        assert cr["status"]["decode"]["ready"] == f"{replicas}/{replicas}"

        def decode_pods_are(count: int = replicas) -> bool:
            return len(pod_uids(cluster, namespace, "decode")) == count

        wait_until(decode_pods_are, 60, f"{replicas} decode pods")
    assert (
        cluster.get_json("sts", "tiny-cpu-prefill", "-n", namespace)["metadata"]["generation"]
        == prefill_generation
    )
    assert pod_uids(cluster, namespace, "prefill") == prefill_pods
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "reason=Scaled")["items"]
    assert any("to 3" in e["message"] for e in events)
    assert any("to 1" in e["message"] for e in events)  # the way back is an Event too
    # one child was scaled, and only it has Scaled Events (prefill's StatefulSet was left alone)
    messages = [e["message"] for e in events]
    assert all(m.startswith("scaled StatefulSet tiny-cpu-decode from ") for m in messages), messages


def test_an_autoscaled_roles_count_is_left_to_its_autoscaler(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """prefill.replicas unset (crds/samples/autoscaled.yaml): an HPA's count on the StatefulSet stays
    through the operator's later applies of that StatefulSet."""
    body = cpu_cr()
    del body["spec"]["prefill"]["replicas"]
    cluster.apply(body, "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    cluster.run("scale", "statefulset", "tiny-cpu-prefill", "-n", namespace, "--replicas=2")  # as an HPA
    wait_until(lambda: len(pod_uids(cluster, namespace, "prefill")) == 2, 60, "two prefill pods")
    before = cluster.get_json("sts", "tiny-cpu-prefill", "-n", namespace)["metadata"]["annotations"]
    body["spec"]["prefill"]["maxNumSeqs"] = 6  # re-renders prefill's StatefulSet
    cluster.apply(body, "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True", timeout=120)
    sts = cluster.get_json("sts", "tiny-cpu-prefill", "-n", namespace)
    assert sts["metadata"]["annotations"][HASH_ANNOTATION] != before[HASH_ANNOTATION], "not re-applied"
    assert sts["spec"]["replicas"] == 2
    wait_until(
        lambda: get_cr(cluster, namespace, "tiny-cpu")["status"]["prefill"]["ready"] == "2/2",
        120,
        "the status counting both of the autoscaler's prefill pods",
    )


def test_deleted_and_edited_children_are_restored(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    old_uid = cluster.get_json("sts", "tiny-cpu-decode", "-n", namespace)["metadata"]["uid"]
    cluster.run("delete", "sts", "tiny-cpu-decode", "-n", namespace, "--wait=true")
    wait_until(
        lambda: cluster.exists("sts", "tiny-cpu-decode", "-n", namespace), 30, "decode to be recreated"
    )
    assert cluster.get_json("sts", "tiny-cpu-decode", "-n", namespace)["metadata"]["uid"] != old_uid
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")

    cluster.run("set", "env", "sts/tiny-cpu-prefill", "-n", namespace, "VLLM_KV_COMPRESSION=int8")

    def compression() -> str:
        sts = cluster.get_json("sts", "tiny-cpu-prefill", "-n", namespace)
        env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
        return str(next(e["value"] for e in env if e["name"] == "VLLM_KV_COMPRESSION"))

    wait_until(lambda: compression() == "none", 30, "the operator to put VLLM_KV_COMPRESSION back")


def test_pod_not_ready_shows_degraded_then_recovers(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    cluster.set_pod_ready(namespace, "tiny-cpu-decode-0", False, "HTTP probe failed with statuscode: 503")
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Degraded", "True")
    assert "tiny-cpu-decode-0 not ready" in condition(cr, "Degraded")["message"]
    assert condition(cr, "DecodeReady")["status"] == "False"
    assert condition(cr, "Ready")["status"] == "False"
    assert condition(cr, "PrefillReady")["status"] == "True"
    cluster.set_pod_ready(namespace, "tiny-cpu-decode-0", True)
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    assert condition(cr, "Degraded")["status"] == "False"


def test_too_many_gpus_is_degraded_with_the_scheduling_reason(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    body = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedLLM",
        "metadata": {"name": "huge"},
        "spec": {
            "model": {"name": "m"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1, "tensorParallelSize": 16},
        },
    }
    cluster.apply(body, "-n", namespace)
    cr = wait_condition(cluster, namespace, "huge", "Degraded", "True")
    message = condition(cr, "Degraded")["message"]
    assert condition(cr, "Degraded")["reason"] == "Unschedulable"
    assert "huge-decode-0 Unschedulable" in message
    assert "Insufficient nvidia.com/gpu" in message
    assert condition(cr, "Ready")["status"] == "False"


def test_status_transition_times_move_only_on_flips(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    before = condition(cr, "PrefillReady")["lastTransitionTime"]
    cluster.run("scale", "dllm/tiny-cpu", "-n", namespace, "--replicas=2")
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    assert cr["status"]["decode"]["ready"] == "2/2"
    assert condition(cr, "PrefillReady")["lastTransitionTime"] == before


@pytest.mark.slow
def test_sigkill_during_20_reconciles_then_restart_converges(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    process = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "op.log", namespace).start()
    names = [f"crash-{i:02d}" for i in range(20)]
    cluster.apply(yaml.safe_dump_all([cpu_cr(name) for name in names]), "-n", namespace)
    wait_until(
        lambda: len(children(cluster, namespace)["statefulsets"]) >= 6, 60, "reconciles to be under way"
    )
    process.kill()
    process = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "op2.log", namespace).start()
    try:
        for name in names:
            wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)
        found = children(cluster, namespace)
        assert found["statefulsets"] == sorted(f"{n}-{r}" for n in names for r in ("decode", "prefill"))
        assert found["deployments"] == sorted(f"{n}-router" for n in names)
        assert len(found["services"]) == 60
        pods = cluster.get_json("pods", "-n", namespace)["items"]
        assert len(pods) == 60  # one per role and CR: no duplicate, no orphan
        # Every child is controlled by its own CR (no child of the killed process left ownerless).
        uids = {
            cr["metadata"]["name"]: cr["metadata"]["uid"]
            for cr in cluster.get_json("dllm", "-n", namespace)["items"]
        }
        for kind in ("statefulsets", "deployments", "services"):
            for child in cluster.get_json(kind, "-n", namespace)["items"]:
                [owner] = child["metadata"]["ownerReferences"]
                assert owner["controller"] is True
                assert owner["uid"] == uids[owner["name"]], child["metadata"]["name"]
                assert child["metadata"]["name"].startswith(f"{owner['name']}-")
    finally:
        process.stop()


@pytest.mark.slow
def test_apiserver_restart_under_a_running_operator(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    if cluster.layout is None:
        pytest.skip("restarts a component of the local control plane")
    from e2e.cluster import controlplane as cp

    cluster.apply(cpu_cr(), "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    cp.restart_component(cluster.layout, "kube-apiserver")
    cluster.run("scale", "dllm/tiny-cpu", "-n", namespace, "--replicas=2")
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True", timeout=90)
    assert cr["status"]["decode"]["ready"] == "2/2"


def test_deleting_the_resource_deletes_every_child(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    cr = get_cr(cluster, namespace, "tiny-cpu")
    assert cr["metadata"].get("finalizers") is None  # deletion never waits for the operator
    cluster.run("delete", "dllm", "tiny-cpu", "-n", namespace)
    empty: dict[str, list[str]] = {
        "statefulsets": [],
        "deployments": [],
        "services": [],
        "poddisruptionbudgets": [],
    }
    wait_until(
        lambda: children(cluster, namespace) == empty, 120, "the garbage collector to remove the children"
    )


def test_router_disabled_prunes_the_router(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(cpu_cr(), "-n", namespace)
    wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    cluster.apply(cpu_cr(router={"enabled": False}), "-n", namespace)
    wait_until(lambda: children(cluster, namespace)["deployments"] == [], 30, "the router to be pruned")
    cr = wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
    assert condition(cr, "RouterReady")["reason"] == "Disabled"
    assert "tiny-cpu-router" not in children(cluster, namespace)["services"]
    pruned = "Deployment tiny-cpu-router is no longer wanted by the spec"

    def deleted_events() -> set[str]:  # Events are posted beside the reconcile, not before it ends
        items = cluster.get_json("events", "-n", namespace)["items"]
        return {e["message"] for e in items if e["reason"] == "Deleted"}

    wait_until(lambda: pruned in deleted_events(), 30, "the Deleted Event for the router")


@pytest.mark.slow
def test_two_replicas_one_leader_and_handover(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    first = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "a.log", namespace).start()
    second = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "b.log", namespace).start()
    try:
        cluster.apply(cpu_cr(), "-n", namespace)
        wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
        leaders = wait_until(
            lambda: [p for p in (first, second) if p.metric("dllm_operator_leader") == 1.0], 30, "a leader"
        )
        assert len(leaders) == 1
        leader, follower = (first, second) if leaders[0] is first else (second, first)
        assert follower.metric("dllm_operator_reconciles_total") == 0
        leader.kill()
        cluster.run("scale", "dllm/tiny-cpu", "-n", namespace, "--replicas=2")
        cr = wait_condition(
            cluster, namespace, "tiny-cpu", "Ready", "True", timeout=60
        )  # past the 15 s lease
        assert cr["status"]["decode"]["ready"] == "2/2"
        assert follower.metric("dllm_operator_leader") == 1.0
        assert follower.metric("dllm_operator_reconciles_total") > 0
    finally:
        first.stop()
        second.stop()


# Short, so that the quiet window holds several full resyncs, each reconciling the CR again.
RESYNC_SECONDS = 3


def test_idle_operator_makes_no_writes(cluster: Cluster, crd: str, namespace: str, tmp_path: Path) -> None:
    operator = OperatorProcess(
        cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace,
        env={"DLLM_RESYNC_SECONDS": str(RESYNC_SECONDS)},
    ).start()  # fmt: skip
    try:
        started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        cluster.apply(cpu_cr(), "-n", namespace)
        wait_condition(cluster, namespace, "tiny-cpu", "Ready", "True")
        converged = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        # A positive control: the filter sees this operator's writes while it converges (the audit log
        # is written in batches, so it is polled). Were it to match none, no write below would prove
        # nothing.
        wait_until(
            lambda: operator_writes(cluster.audit_entries(), {namespace}, started),
            30,
            "the operator's writes of the convergence in the audit log",
        )

        # Not even a refused create of the auth Secret: a deleted one comes back when a pod reports it
        # missing, not by a create at every resync (500 refused writes per resync at 500 resources).
        def writes_since_converged() -> list[tuple[str, str, str, int]]:
            return [
                (w["verb"], w["objectRef"].get("resource", ""), w["objectRef"].get("name", ""),
                 w.get("responseStatus", {}).get("code", 0))
                for w in operator_writes(cluster.audit_entries(), {namespace}, converged)
            ]  # fmt: skip

        resyncs, reconciles = (
            operator.metric(f"dllm_operator_{name}_total") for name in ("resyncs", "reconciles")
        )

        def three_quiet_resyncs() -> bool:
            assert writes_since_converged() == []
            return operator.metric("dllm_operator_resyncs_total") >= resyncs + 3

        wait_until(three_quiet_resyncs, RESYNC_SECONDS * 3 + 60, "three resyncs")
        assert operator.metric("dllm_operator_reconciles_total") >= reconciles + 3  # each resync reconciled
        # Entries of the last resync may still be on their way to the audit log.
        assert holds_for(writes_since_converged, RESYNC_SECONDS) == []
    finally:
        operator.stop()
