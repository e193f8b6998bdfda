"""What render_all makes of a DisaggregatedLLM, and the lookups the render tests share."""

from __future__ import annotations

from typing import Any

from dllm_cases import merged

from dllm_operator.api import parse
from dllm_operator.render import render_all

UID = "11111111-2222-3333-4444-555555555555"


def rendered(body: dict[str, Any]) -> list[dict[str, Any]]:
    body = merged(body, {"metadata": {"namespace": "serving", "uid": UID}})
    return render_all(parse(body))


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def env_of(statefulset: dict[str, Any]) -> dict[str, Any]:
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
