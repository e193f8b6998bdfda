"""Prometheus text-format metrics, kept cheap enough to update on every request."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable

from dllm_router.endpoints import Pool

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

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
)


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def render(self, name: str, labels: str) -> Iterable[str]:
        sep = "," if labels else ""
        running = 0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            yield f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}'
        yield f"{name}_sum{{{labels}}} {self.total}"
        yield f"{name}_count{{{labels}}} {running}"


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.errors: Counter[str] = Counter()
        self.retries = 0
        self.prefill_answers = 0  # answered by prefill alone (EOS at the first token, or max_tokens 1)
        self.fast_requests = 0  # generation requests taken by the fast path (callbacks, no task)
        self.prefill_seconds = Histogram()
        self.decode_first_byte_seconds = Histogram()
        self.ttft_seconds = Histogram()
        self.open_connections: Callable[[], int] = lambda: 0  # the HTTP server's, set by serve()

    def render(self, pools: Iterable[Pool]) -> str:
        lines = ["# TYPE dllm_router_requests_total counter"]
        lines += [
            f'dllm_router_requests_total{{route="{route}",code="{code}"}} {n}'
            for (route, code), n in sorted(self.requests.items())
        ]
        lines.append("# TYPE dllm_router_errors_total counter")
        lines += [f'dllm_router_errors_total{{kind="{k}"}} {self.errors[k]}' for k in ERROR_KINDS]
        lines += [
            "# TYPE dllm_router_retries_total counter",
            f"dllm_router_retries_total {self.retries}",
            "# TYPE dllm_router_prefill_only_answers_total counter",
            f"dllm_router_prefill_only_answers_total {self.prefill_answers}",
        ]
        for name, hist in (
            ("dllm_router_prefill_seconds", self.prefill_seconds),
            ("dllm_router_decode_first_byte_seconds", self.decode_first_byte_seconds),
            ("dllm_router_ttft_seconds", self.ttft_seconds),
        ):
            lines.append(f"# TYPE {name} histogram")
            lines += hist.render(name, "")
        lines += [
            "# TYPE dllm_router_open_connections gauge",
            f"dllm_router_open_connections {self.open_connections()}",
        ]
        lines += ["# TYPE dllm_router_inflight gauge", "# TYPE dllm_router_pod_ready gauge"]
        for pool in pools:
            for ep in pool.endpoints.values():
                labels = f'role="{pool.role}",pod="{ep.name}"'
                lines.append(f"dllm_router_inflight{{{labels}}} {ep.inflight}")
                lines.append(f"dllm_router_pod_ready{{{labels}}} {int(ep.healthy)}")
        return "\n".join(lines) + "\n"
