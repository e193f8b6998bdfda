"""vLLM's metric classes bound to one test's own registry (vLLM's default one is process-wide, and
the connector's metrics may be registered there once only)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def metric_types(registry: CollectorRegistry) -> dict[type, type]:
    return {base: _bound(base, registry) for base in (Gauge, Counter, Histogram)}


def _bound(base: Any, registry: CollectorRegistry) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **(kwargs | {"registry": registry}))

    return type(f"Private{base.__name__}", (base,), {"__init__": init})
