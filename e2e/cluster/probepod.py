"""Pods of the node's probe image (e2e/cluster/probe/main.go) placed on the real node, as the node tests
use them: a server (`serve`, Ready through an HTTP probe), a client that runs once, or a pod to exec
`probe dial`/`probe watch` in. Pure manifests; nothing here talks to the cluster."""

from __future__ import annotations

from typing import Any

from e2e.cluster import nodeconfig as nc

PORT = 8080


def probe_pod(
    name: str, namespace: str, args: list[str], image: str, labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    """A pod running `probe ARGS...` on the real node, labelled app=NAME plus `labels`."""
    container: dict[str, Any] = {"name": "probe", "image": image, "imagePullPolicy": "Never", "args": args}
    if args[0] == "serve":
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name, **(labels or {})}},
        "spec": {
            "nodeSelector": dict([nc.LABEL]), "tolerations": [{**nc.TAINT, "operator": "Equal"}],
            "terminationGracePeriodSeconds": 1, "containers": [container], **spec,
        },
    }  # fmt: skip


def server(name: str, namespace: str, image: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return probe_pod(name, namespace, ["serve", f":{PORT}"], image, labels)
