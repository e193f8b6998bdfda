"""The router's metrics: cheap to update on every request, exposed through prometheus_client."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import prometheus_client
import prometheus_client.registry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dllm_router.endpoints import Pool
from dllm_router.fingerprint_pairs import FingerprintPairs
from dllm_router.histogram import Histogram
from dllm_router.pair_latency import PairLatency

ERROR_KINDS = (
    "bad_request",
    "no_prefill",
    "no_decode",
    "prefill_error",
    "decode_error",
    "prefill_unreachable",
    "decode_unreachable",
    "timeout",
    "stream_broken",
    "client_disconnect",
    "request_timeout",  # a head or body over its deadline (408)
    "too_many_connections",  # refused over --max-connections (503)
    "answer_too_large",  # engine answers over --max-answer-mb for one request (502)
    "memory_budget",  # the router's --memory-budget-mb held by requests in flight (503)
)

# sent: decode answered 2xx; failed: an error status, no answer or a timeout; dropped: too many in flight
TRANSFER_END_OUTCOMES = ("sent", "failed", "dropped")


class Metrics:
    """The router's counters: plain integers on the request path (the router's per-request budget is
    tens of microseconds); prometheus_client writes the exposition at scrape time (`Collector`)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.errors: Counter[str] = Counter()
        self.retries = 0
        self.prefill_answers = 0  # answered by prefill alone (EOS at the first token, or max_tokens 1)
        self.fast_requests = 0  # generation requests taken by the fast path (callbacks, no task)
        self.transfer_ends: Counter[str] = Counter()  # TRANSFER_END_OUTCOMES (M2, transfer_end.py)
        self.prefill_seconds = Histogram()
        self.decode_first_byte_seconds = Histogram()
        self.ttft_seconds = Histogram()
        self.open_connections: Callable[[], int] = lambda: 0  # the HTTP server's, set by serve()
        self.evicted_connections: Callable[[], int] = lambda: 0  # the same
        self.budget_held: Callable[[], int] = lambda: 0  # NEW-1: bytes held of the memory budget
        self.budget_limit = 0
        self.kv_check: Callable[[], Iterable[Metric]] = lambda: ()  # the KV check's families (kv_check.py)
        self.pairs = PairLatency()  # the latencies above, per prefill/decode pair
        self.fingerprint_pairs = FingerprintPairs()
        self._over_all_pairs = {
            "prefill": self.prefill_seconds,
            "decode_first_byte": self.decode_first_byte_seconds,
            "ttft": self.ttft_seconds,
        }

    def observe(
        self, kind: Literal["prefill", "decode_first_byte", "ttft"], prefill: str, decode: str, seconds: float
    ) -> None:
        """One latency of a request, over all pairs and for its own pair of pods."""
        self._over_all_pairs[kind].observe(seconds)
        self.pairs.observe(kind, prefill, decode, seconds)

    def families(self, pools: Iterable[Pool]) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "dllm_router_requests", "Requests answered, by route and status code", labels=["route", "code"]
        )
        for (route, code), n in sorted(self.requests.items()):
            requests.add_metric([route, str(code)], n)
        yield requests
        errors = CounterMetricFamily("dllm_router_errors", "Requests that failed, by kind", labels=["kind"])
        for kind in ERROR_KINDS:
            errors.add_metric([kind], self.errors[kind])
        yield errors
        yield CounterMetricFamily(
            "dllm_router_retries", "Engine calls retried on another pod", value=self.retries
        )
        yield CounterMetricFamily(
            "dllm_router_prefill_only_answers",
            "Answers prefill finished alone (EOS at the first token, or max_tokens 1)",
            value=self.prefill_answers,
        )
        ends = CounterMetricFamily(
            "dllm_router_transfer_ends",
            "Transfer ids the router told a decode pod to end after decode failed (dllm flow), by outcome",
            labels=["outcome"],
        )
        for outcome in TRANSFER_END_OUTCOMES:
            ends.add_metric([outcome], self.transfer_ends[outcome])
        yield ends
        yield self.prefill_seconds.family("dllm_router_prefill_seconds", "Prefill call duration")
        yield self.decode_first_byte_seconds.family(
            "dllm_router_decode_first_byte_seconds", "From prefill's answer to decode's first byte"
        )
        yield self.ttft_seconds.family("dllm_router_ttft_seconds", "Time to the first byte for the client")
        yield GaugeMetricFamily(
            "dllm_router_open_connections", "Client connections open", value=self.open_connections()
        )
        yield CounterMetricFamily(
            "dllm_router_evicted_connections",
            "Idle client connections closed to make room for a new one at --max-connections",
            value=self.evicted_connections(),
        )
        held = GaugeMetricFamily(
            "dllm_router_memory_budget_bytes",
            "Bytes of client bodies and engine answers held now, and the limit (--memory-budget-mb)",
            labels=["state"],
        )
        held.add_metric(["held"], self.budget_held())
        held.add_metric(["limit"], self.budget_limit)
        yield held
        inflight = GaugeMetricFamily(
            "dllm_router_inflight", "Requests in flight per engine pod", labels=["role", "pod"]
        )
        ready = GaugeMetricFamily(
            "dllm_router_pod_ready", "1 if the pod answers /health", labels=["role", "pod"]
        )
        fingerprint = GaugeMetricFamily(
            "dllm_router_pod_kv_fingerprint",
            "1 under the KV fingerprint each pod's /health names (pods pair only within one)",
            labels=["role", "pod", "fingerprint"],
        )
        for pool in pools:
            for ep in pool.endpoints.values():
                inflight.add_metric([pool.role, ep.name], ep.inflight)
                ready.add_metric([pool.role, ep.name], int(ep.healthy))
                if ep.fingerprint is not None:
                    fingerprint.add_metric([pool.role, ep.name, ep.fingerprint], 1)
        yield inflight
        yield ready
        yield fingerprint
        current = {ep.fingerprint for pool in pools for ep in pool.endpoints.values()}
        yield from self.fingerprint_pairs.families(current)
        yield from self.pairs.families({ep.name for pool in pools for ep in pool.endpoints.values()})
        yield from self.kv_check()


class Collector(prometheus_client.registry.Collector):
    """Hands the router's counters to a registry of its own (no process or GC metrics of the library)."""

    def __init__(self, metrics: Metrics, pools: Callable[[], Iterable[Pool]]) -> None:
        self._metrics, self._pools = metrics, pools

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families(self._pools())


def exposition(metrics: Metrics, pools: Callable[[], Iterable[Pool]]) -> Callable[[], bytes]:
    """The /metrics page: Prometheus text format, written by prometheus_client."""
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(Collector(metrics, pools))
    return lambda: prometheus_client.generate_latest(registry)
