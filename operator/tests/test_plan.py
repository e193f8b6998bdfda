"""The drift check decides whether the operator writes: a converged cluster plans no write (the API
server's defaults and its spelling of quantities are not drift), and a field someone changed is."""

from __future__ import annotations

from typing import Any

import pytest

from dllm_operator.plan import needs_apply, same
from dllm_operator.render import HASH_ANNOTATION
from dllm_operator.render.quantity import amount, to_bytes


def statefulset(memory: str, replicas: int | None = 1, hash_: str = "h1") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {"spec": {"containers": [{"name": "vllm", "resources": {"limits": {"memory": memory}}}]}}
    }
    if replicas is not None:
        spec["replicas"] = replicas
    meta = {"name": "x-decode", "annotations": {HASH_ANNOTATION: hash_}}
    return {"kind": "StatefulSet", "metadata": meta, "spec": spec}


def test_quantities_as_the_api_server_spells_them_are_no_drift() -> None:
    assert same("1024Mi", "1Gi")
    assert same("0.5", "500m")
    assert same("2000m", 2)
    assert same("1e3", "1k")  # every form the API model admits is read
    assert same("+1Gi", "1Gi")
    assert not same("1Gi", "1G")  # binary and decimal are different amounts
    assert not same("1Gi", "lots")


def test_what_the_api_server_adds_or_leaves_out_is_no_drift() -> None:
    desired = statefulset("1Gi")
    actual = statefulset("1024Mi")
    actual["spec"]["podManagementPolicy"] = "OrderedReady"  # a default the server filled in
    actual["status"] = {"replicas": 1}
    desired["spec"]["template"]["spec"]["containers"][0]["env"] = []  # omitted by the server
    assert not needs_apply(desired, actual)


def test_a_changed_field_a_new_hash_or_a_missing_child_needs_a_write() -> None:
    assert needs_apply(statefulset("1Gi"), None)
    assert needs_apply(statefulset("1Gi"), statefulset("2Gi"))
    assert needs_apply(statefulset("1Gi"), statefulset("1Gi", replicas=3))
    assert needs_apply(statefulset("1Gi", hash_="h2"), statefulset("1Gi"))


def test_an_autoscaled_count_is_not_drift() -> None:
    """Desired leaves replicas out when an autoscaler owns them."""
    assert not needs_apply(statefulset("1Gi", replicas=None), statefulset("1Gi", replicas=5))


def test_amount_reads_every_suffix_and_refuses_what_is_not_a_quantity() -> None:
    assert [amount(q) for q in ("1Ki", "1k", "1.5Gi", ".5", "250m", 7)] == [
        1024,
        1000,
        1.5 * 2**30,
        0.5,
        0.25,
        7,
    ]
    assert [amount(q) for q in ("+2", "1e3", "5E-1", "100u", "3n")] == pytest.approx(
        [2, 1000, 0.5, 1e-4, 3e-9]
    )
    assert [amount(q) for q in ("1Xi", "", "Gi", True, None, 1.5, "1e", "1Ki2")] == [None] * 8
    assert to_bytes("1.5Mi") == 1572864
