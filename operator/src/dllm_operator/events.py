"""Kubernetes Events about a DisaggregatedLLM, as the operator writes them."""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Any

from dllm_operator.api import API_VERSION, KIND


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cr_event(body: dict[str, Any], reason: str, message: str, warning: bool = False) -> dict[str, Any]:
    meta = body["metadata"]
    stamp = now_iso()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        },
        "reason": reason,
        "message": message[:1000],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "dllm-operator"},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
