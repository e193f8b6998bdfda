"""The CPU sample's model on the real node: the tiny model made here, offered read-only through a
PersistentVolume (hostPath on the node, which shares this machine's files) bound to the claim `models`
that crds/samples/cpu-tiny.yaml names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from e2e.dataplane.tiny_model import build

# As tools/venv.sh places its cache: DLLM_CACHE, else $XDG_CACHE_HOME/dllm, else ~/.cache/dllm.
_HOME_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
CACHE = Path(os.environ.get("DLLM_CACHE", _HOME_CACHE / "dllm"))
MODELS = CACHE / "models"
CLAIM = "models"


def make_model() -> Path:
    """The tiny model under the cache (made once), readable by the engines' non-root user."""
    model = build(MODELS / "tiny-llama")
    for path in (MODELS, model, *model.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


def volume_name(namespace: str) -> str:
    return f"dllm-models-{namespace}"


def manifests(namespace: str) -> list[dict[str, Any]]:
    """A PersistentVolume on the real node and the claim that binds only it (no provisioner involved)."""
    name = volume_name(namespace)
    node_term = {"matchExpressions": [{"key": "dllm.dev/node", "operator": "In", "values": ["real"]}]}
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "dllm-demo"}},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "claimRef": {"namespace": namespace, "name": CLAIM},
            "hostPath": {"path": str(MODELS), "type": "Directory"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [node_term]}},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [volume, claim]
