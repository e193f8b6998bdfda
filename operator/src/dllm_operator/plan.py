"""Pure planning: which desired children need a write, and which existing children must go.

A child needs an apply when it is missing, when its desired-hash annotation differs (the spec changed),
or when a field the operator sets was changed by someone else (drift). The drift check tolerates what the
API server adds (defaults, status, managedFields) and how it spells what we wrote (zero values omitted,
quantities in canonical form), so a converged cluster plans no write at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dllm_operator.render import HASH_ANNOTATION, quantity

# Kinds the operator creates, in the order it applies them; pods are the controllers' business.
MANAGED_KINDS = ("NetworkPolicy", "Service", "StatefulSet", "PodDisruptionBudget", "Deployment")
Key = tuple[str, str]  # (kind, name)


def key_of(obj: dict[str, Any]) -> Key:
    return obj["kind"], obj["metadata"]["name"]


def _is_zero(value: object) -> bool:
    return value in (None, False, 0, "", [], {})


def same(desired: object, actual: object) -> bool:
    """Whether `actual` holds every field of `desired` with an equal value."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return all(_is_zero(v) for v in desired.values()) and _is_zero(actual)
        return all(same(value, actual.get(name)) for name, value in desired.items())
    if isinstance(desired, list):
        if _is_zero(desired) and _is_zero(actual):
            return True
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(same(d, a) for d, a in zip(desired, actual, strict=True))
        )
    if desired == actual or (_is_zero(desired) and actual is None):
        return True
    wanted, found = quantity.amount(desired), quantity.amount(actual)
    return wanted is not None and wanted == found and isinstance(desired, str)


def needs_apply(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    if actual is None:
        return True
    wanted_hash = desired["metadata"]["annotations"][HASH_ANNOTATION]
    if actual.get("metadata", {}).get("annotations", {}).get(HASH_ANNOTATION) != wanted_hash:
        return True
    # The replica count of an autoscaled role is not ours: desired leaves it out, so `same` ignores it.
    return not same({k: v for k, v in desired.items() if k != "status"}, actual)


@dataclass(frozen=True)
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[Key] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.apply and not self.delete


def owned_by(obj: dict[str, Any], owner_uid: str) -> bool:
    return any(
        ref.get("uid") == owner_uid and ref.get("controller")
        for ref in obj.get("metadata", {}).get("ownerReferences", [])
    )


def plan(desired: list[dict[str, Any]], actual: dict[Key, dict[str, Any]], owner_uid: str) -> Plan:
    """Writes that bring `actual` (the CR's children as last seen) to `desired`."""
    wanted = {key_of(d): d for d in desired}
    to_apply = [d for key, d in wanted.items() if needs_apply(d, actual.get(key))]
    to_delete = [
        key
        for key, obj in actual.items()
        if key[0] in MANAGED_KINDS and key not in wanted and owned_by(obj, owner_uid)
    ]
    return Plan(apply=to_apply, delete=sorted(to_delete))


def only_replicas_changed(desired: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """A scale, not a rollout: everything but spec.replicas already matches."""
    if actual is None or "replicas" not in desired.get("spec", {}):
        return False
    spec_without = {k: v for k, v in desired["spec"].items() if k != "replicas"}
    return same(spec_without, actual.get("spec", {})) and desired["spec"]["replicas"] != actual["spec"].get(
        "replicas"
    )
