"""The CPU sample as the control-plane tests use it: on the kwok nodes, which mark pods Running without
running them, instead of the real node the sample asks for (crds/samples/cpu-tiny.yaml)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CPU_SAMPLE = Path(__file__).resolve().parents[1] / "crds" / "samples" / "cpu-tiny.yaml"
KWOK_NODES = {"type": "kwok"}


def on_kwok_nodes(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with every role and the router placed on kwok's nodes, and no model volume (nothing runs)."""
    body = copy.deepcopy(body)
    spec = body["spec"]
    spec["model"].pop("source", None)
    for part in ("prefill", "decode", "router"):
        block = spec.setdefault(part, {})
        block["nodeSelector"] = dict(KWOK_NODES)
        block.pop("tolerations", None)
    return body


def cpu_sample_on_kwok() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(CPU_SAMPLE.read_text())
    return on_kwok_nodes(body)
