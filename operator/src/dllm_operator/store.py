"""What the operator last saw: every CR, its children and its pods, kept current by events and relists."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from dllm_operator.plan import Key, key_of
from dllm_operator.render import labels

CRKey = tuple[str, str]  # (namespace, name)


def version_number(value: str) -> int:
    """A resourceVersion as a number, to order two of one kind: Kubernetes 1.35 made them comparable
    (KEP-5504: decimal digits, a later write a larger number). One that is not such a number (from a
    server that does not follow it) counts as the oldest, so whatever arrives next replaces it."""
    return int(value) if value.isascii() and value.isdecimal() else 0


def _resource_version(obj: dict[str, Any]) -> int:
    return version_number(str(obj.get("metadata", {}).get("resourceVersion", "")))


# What the operator reads of a pod (status.py, rollout.py, kv_poll.py, secret_missing.py): at 500
# resources their pods, kept whole, were most of its memory (docs/benchmarks.md).
_POD_METADATA = ("name", "namespace", "uid", "labels", "resourceVersion", "deletionTimestamp")
_POD_STATUS = ("phase", "podIP", "conditions", "containerStatuses", "initContainerStatuses")


def kept(obj: dict[str, Any]) -> dict[str, Any]:
    """The part of a child the store keeps: of a pod, what the operator reads (its containers' names
    and ports of its spec); of any other child, all but managedFields, which the plan never reads."""
    meta = obj.get("metadata", {})
    if obj.get("kind") != "Pod":
        if "managedFields" not in meta:
            return obj
        return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    status = obj.get("status", {})
    containers = obj.get("spec", {}).get("containers", [])
    return {
        "kind": "Pod",
        "metadata": {k: meta[k] for k in _POD_METADATA if k in meta},
        "spec": {"containers": [{"name": c.get("name"), "ports": c.get("ports", [])} for c in containers]},
        "status": {k: status[k] for k in _POD_STATUS if k in status},
    }


@dataclass
class Store:
    """The last seen state of every CR and every child, by owning CR."""

    resources: dict[CRKey, dict[str, Any]] = field(default_factory=dict)
    children: dict[CRKey, dict[Key, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    pods: dict[CRKey, dict[str, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))

    @staticmethod
    def owner_key(obj: dict[str, Any]) -> CRKey | None:
        meta = obj.get("metadata", {})
        instance = meta.get("labels", {}).get(labels.INSTANCE)
        return (meta.get("namespace", ""), instance) if instance else None

    def put_resource(self, body: dict[str, Any], deleted: bool = False) -> CRKey:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if deleted:
            self.resources.pop(key, None)
        else:
            self.resources[key] = body
        return key

    def put_child(self, obj: dict[str, Any], deleted: bool = False) -> CRKey | None:
        key = self.owner_key(obj)
        if key is None:
            return None
        if obj.get("kind") == "Pod":
            bucket: dict[Any, dict[str, Any]] = self.pods[key]
            child_key: Any = obj["metadata"]["name"]
        else:
            bucket, child_key = self.children[key], key_of(obj)
        if deleted:
            bucket.pop(child_key, None)
        elif _resource_version(obj) >= _resource_version(bucket.get(child_key, {})):
            bucket[child_key] = kept(obj)
        return key

    def merge_listing(self, listed: Store, listed_at: int) -> set[CRKey]:
        """Take a fresh listing: newer objects replace older ones, and an object the listing lacks is
        dropped unless it changed after the listing was taken. Returns the CR keys that are gone.

        kopf re-lists after a watch gap without DELETED events for what vanished meanwhile; without
        this, a child deleted in the gap is never recreated and a deleted CR is reconciled forever.
        """

        def merge(mine: dict[Any, dict[str, Any]], theirs: dict[Any, dict[str, Any]]) -> None:
            for name in [name for name in mine if name not in theirs]:
                if listed_at and _resource_version(mine[name]) <= listed_at:  # 0: when is unknown
                    del mine[name]
            for name, obj in theirs.items():
                if _resource_version(obj) >= _resource_version(mine.get(name, {})):
                    mine[name] = obj

        before = set(self.resources)
        merge(self.resources, listed.resources)
        for key in set(self.children) | set(listed.children):
            merge(self.children[key], listed.children.get(key, {}))
        for key in set(self.pods) | set(listed.pods):
            merge(self.pods[key], listed.pods.get(key, {}))
        return before - set(self.resources)
