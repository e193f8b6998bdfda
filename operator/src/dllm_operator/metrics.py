"""Prometheus metrics of the operator (served on /metrics by runner.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()
RECONCILES = Counter("dllm_operator_reconciles", "Reconciles run", registry=REGISTRY)
ERRORS = Counter(
    "dllm_operator_reconcile_errors", "Reconciles that failed, by error type", ["error"], registry=REGISTRY
)
DURATION = Histogram(
    "dllm_operator_reconcile_duration_seconds",
    "Time of one reconcile",
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RESYNCS = Counter(
    "dllm_operator_resyncs", "Full listings merged into the caches (the periodic resync)", registry=REGISTRY
)
MANAGED = Gauge("dllm_operator_managed_resources", "DisaggregatedLLM resources watched", registry=REGISTRY)
LEADER = Gauge("dllm_operator_leader", "1 while this replica holds the leader lease", registry=REGISTRY)
