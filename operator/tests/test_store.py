"""The operator's cache orders what it sees by resourceVersion, as numbers (Kubernetes 1.35's comparable
resource versions): a stale event never replaces a newer object, and a relist drops only what vanished
before it was taken."""

from __future__ import annotations

from typing import Any

from dllm_operator.render import labels
from dllm_operator.store import Store, version_number


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
