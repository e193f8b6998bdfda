"""The chart's Grafana dashboard, read as its queries: which metric each one names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "dllm-operator" / "dashboards" / "dllm.json"
# The dashboard writes every metric with a selector: `name{...}` (the resource's namespace and name).
_METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
# What a histogram's or a counter's series add to the family's name on /metrics.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every panel's PromQL, in panel order."""
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def on_metrics(name: str, metrics_texts: list[str]) -> bool:
    """Whether a series of that exact name is on one of these /metrics texts."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{|\s)", re.MULTILINE)
    return any(pattern.search(text) for text in metrics_texts)
