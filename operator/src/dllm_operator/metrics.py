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
# The autoscaler's view per resource and role (issue 36), for KEDA or an HPA on external metrics to
# act on the same signals: removed when the resource is, or turns autoscaling off.
AUTOSCALING_SIGNAL = Gauge(
    "dllm_operator_autoscaling_signal",
    "The measure each autoscaled role's target reads (absent: no fresh signal)",
    ["namespace", "name", "role", "measure"],
    registry=REGISTRY,
)
AUTOSCALING_RECOMMENDED = Gauge(
    "dllm_operator_autoscaling_recommended_replicas",
    "The replicas the autoscaler recommends per role",
    ["namespace", "name", "role"],
    registry=REGISTRY,
)
