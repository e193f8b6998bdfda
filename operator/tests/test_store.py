"""The operator's cache orders what it sees by resourceVersion, as numbers (Kubernetes 1.35's comparable
resource versions): a stale event never replaces a newer object, and a relist drops only what vanished
before it was taken."""

from __future__ import annotations

from typing import Any

from dllm_operator.render import labels
from dllm_operator.store import Store, kept, version_number


def child(name: str, version: str, kind: str = "Service") -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "resourceVersion": version, "labels": {labels.INSTANCE: "cr"}}
    return {"kind": kind, "metadata": meta}


def cr(version: str) -> dict[str, Any]:
    return {
        "kind": "DisaggregatedLLM",
        "metadata": {"name": "cr", "namespace": "ns", "resourceVersion": version},
    }


def test_resource_versions_are_ordered_as_numbers_not_as_text() -> None:
    store = Store()
    store.put_child(child("router", "9"))
    store.put_child(child("router", "10"))
    store.put_child(child("router", "9"))  # a late event of the older write
    assert store.children[("ns", "cr")][("Service", "router")]["metadata"]["resourceVersion"] == "10"


def test_a_resource_version_that_is_no_number_is_replaced_by_the_next_arrival() -> None:
    assert [version_number(v) for v in ("123", "", "1_0", "-5", " 7", "²", "x1")] == [123, 0, 0, 0, 0, 0, 0]
    store = Store()
    store.put_child(child("router", "opaque"))
    store.put_child(child("router", "5"))
    assert store.children[("ns", "cr")][("Service", "router")]["metadata"]["resourceVersion"] == "5"


def test_a_relist_drops_what_vanished_before_it_and_keeps_what_changed_after() -> None:
    store = Store()
    store.put_resource(cr("3"))
    store.put_child(child("gone", "4"))
    store.put_child(child("newer-than-the-list", "12"))
    store.put_child(child("decode-0", "6", kind="Pod"))
    listed = Store()
    listed.put_resource(cr("3"))
    gone_crs = store.merge_listing(listed, listed_at=10)
    assert gone_crs == set()
    assert set(store.children[("ns", "cr")]) == {("Service", "newer-than-the-list")}
    assert store.pods[("ns", "cr")] == {}


def test_a_relist_forgets_a_cr_deleted_during_a_watch_gap() -> None:
    store = Store()
    store.put_resource(cr("3"))
    assert store.merge_listing(Store(), listed_at=10) == {("ns", "cr")}
    assert store.resources == {}


def test_a_relist_whose_moment_is_unknown_drops_nothing() -> None:
    store = Store()
    store.put_resource(cr("3"))
    store.put_child(child("router", "4"))
    store.put_child(child("opaque", "not-a-number"))  # counts as 0: no older than an unknown moment
    assert store.merge_listing(Store(), listed_at=version_number("")) == set()
    assert set(store.children[("ns", "cr")]) == {("Service", "router"), ("Service", "opaque")}


def test_the_store_keeps_of_a_pod_what_the_operator_reads_and_drops_managed_fields() -> None:
    pod: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {
            "name": "x-decode-0",
            "namespace": "ns",
            "uid": "u",
            "resourceVersion": "7",
            "labels": {labels.INSTANCE: "x", labels.COMPONENT: "decode"},
            "deletionTimestamp": "2026-12-06T10:00:00Z",
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
            "annotations": {"big": "x" * 1000},
        },
        "spec": {
            "containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8000}], "env": []}],
            "volumes": [{"name": "models"}],
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "vllm", "ready": True}],
            "qosClass": "Burstable",
        },
    }
    kept_pod = kept(pod)
    assert kept_pod == {
        "kind": "Pod",
        "metadata": {k: pod["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion", "labels",
                                                     "deletionTimestamp")},
        "spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {k: pod["status"][k] for k in ("phase", "podIP", "conditions", "containerStatuses")},
    }  # fmt: skip
    store = Store()
    store.put_child(pod)
    assert store.pods[("ns", "x")]["x-decode-0"] == kept_pod
    sts = {
        "kind": "StatefulSet",
        "metadata": {**pod["metadata"], "name": "x-decode"},
        "spec": {"replicas": 1},
    }
    store.put_child(sts)
    stored = store.children[("ns", "x")][("StatefulSet", "x-decode")]
    assert "managedFields" not in stored["metadata"]
    assert stored["spec"] == sts["spec"]
    assert stored["metadata"]["annotations"] == pod["metadata"]["annotations"]
    assert "managedFields" in sts["metadata"]  # the event's own object is left as it was
