"""A Prometheus histogram the request path can afford: one list increment per observation."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.core import HistogramMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Counts per bucket and a sum: one list increment per observation on the request path."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative (upper bound, count) pairs as Prometheus writes them, and the sum."""
        running, buckets = 0, []
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return buckets, self.total

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        buckets, total = self.buckets()
        family = HistogramMetricFamily(name, documentation)
        family.add_metric([], buckets, total)
        return family
