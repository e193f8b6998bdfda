"""The autoscaler's recommendation and signals as the operator's own metrics (issue 36), so KEDA or an
HPA on external metrics can act on the same numbers: one series per resource, role and measure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dllm_operator import metrics

ROLES = ("prefill", "decode")
# The label values set per resource, so that they can be removed (prometheus_client keeps a child per
# label set until told otherwise).
_set: dict[tuple[str, str], list[tuple[Any, tuple[str, ...]]]] = {}


def export(namespace: str, name: str, status: Mapping[str, Any]) -> None:
    """Set the series of one resource from its status.autoscaling (dropping a role's stale signal)."""
    forget(namespace, name)
    made: list[tuple[Any, tuple[str, ...]]] = []
    for role in ROLES:
        found = status.get(role)
        if not isinstance(found, Mapping):
            continue
        labels: tuple[str, ...] = (namespace, name, role)
        metrics.AUTOSCALING_RECOMMENDED.labels(*labels).set(found["replicas"])
        made.append((metrics.AUTOSCALING_RECOMMENDED, labels))
        if "value" in found:
            measured = (*labels, str(found["measure"]))
            metrics.AUTOSCALING_SIGNAL.labels(*measured).set(found["value"])
            made.append((metrics.AUTOSCALING_SIGNAL, measured))
    _set[(namespace, name)] = made


def forget(namespace: str, name: str) -> None:
    """Remove every series of the resource."""
    for gauge, labels in _set.pop((namespace, name), []):
        gauge.remove(*labels)
