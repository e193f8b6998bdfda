"""The autoscaler's signals, read from metrics pages, pure (issue 36).

Two scrapes of the same pages, a scrape interval apart, give each role's measure (decide.Signal):

- prefill, queued prompt tokens: over prefill pods, the requests waiting (vLLM's
  `vllm:num_requests_waiting`) times the mean prompt of the requests that pod finished between the
  scrapes (`vllm:request_prompt_tokens`), or over its life when it finished none;
- decode, KV-cache usage: the mean of decode pods' `vllm:kv_cache_usage_perc`;
- time to first token and inter-token latency: the 90th percentile of the observations between the
  scrapes, from the router's histograms (`dllm_router_ttft_seconds`, and
  `dllm_router_pair_inter_token_seconds` summed over its pairs).

Pages come from engines and routers over the network: a page that does not parse, or lacks a metric,
gives no value (never a zero), and the caller says so in status.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from dllm_operator.api.autoscaling import AutoscalingSpec
from dllm_operator.autoscale.decide import Role, Signal

WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS = "vllm:request_prompt_tokens"
TTFT_HISTOGRAM = "dllm_router_ttft_seconds"
ITL_HISTOGRAM = "dllm_router_pair_inter_token_seconds"
QUANTILE = 0.9


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (inf last), their sum and count, over every label set."""

    buckets: tuple[tuple[float, float], ...]
    total: float
    count: float

    def minus(self, before: Histogram | None) -> Histogram:
        """The observations since `before` (the same series, scraped earlier); all of them when the
        series restarted (a count that went down) or there was none."""
        if (
            before is None
            or before.count > self.count
            or [b for b, _ in before.buckets] != [b for b, _ in self.buckets]
        ):
            return self
        earlier = dict(before.buckets)
        return Histogram(
            tuple((bound, n - earlier[bound]) for bound, n in self.buckets),
            self.total - before.total,
            self.count - before.count,
        )

    def plus(self, other: Histogram) -> Histogram | None:
        """Both series' observations together; None when their buckets differ."""
        if [b for b, _ in self.buckets] != [b for b, _ in other.buckets]:
            return None
        theirs = dict(other.buckets)
        summed = tuple((bound, n + theirs[bound]) for bound, n in self.buckets)
        return Histogram(summed, self.total + other.total, self.count + other.count)

    def quantile(self, q: float) -> float | None:
        """As PromQL's histogram_quantile: linear within the bucket that holds it; None without
        observations; the highest finite bound when it falls in the last bucket."""
        if self.count <= 0 or not self.buckets:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True)
class Page:
    """The values of one metrics page the autoscaler reads (None: absent)."""

    gauges: Mapping[str, float]
    histograms: Mapping[str, Histogram]


def read_page(text: str) -> Page | None:
    """The page's gauges (summed over label sets) and histograms of the names above; None when it
    does not parse."""
    gauges: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in (WAITING, KV_USAGE):
                gauges[family.name] = sum(s.value for s in family.samples)
            elif family.name in (PROMPT_TOKENS, TTFT_HISTOGRAM, ITL_HISTOGRAM):
                found = parts.setdefault(family.name, {})
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        key = f"le={float(sample.labels['le'])!r}"
                    elif sample.name.endswith(("_sum", "_count")):
                        key = sample.name.rsplit("_", 1)[-1]
                    else:
                        continue
                    found[key] = found.get(key, 0.0) + sample.value
    except (ValueError, KeyError, TypeError):
        return None
    histograms = {}
    for name, found in parts.items():
        bounds = sorted(float(key[3:]) for key in found if key.startswith("le="))
        if bounds and "sum" in found and "count" in found:
            buckets = tuple((bound, found[f"le={bound!r}"]) for bound in bounds)
            histograms[name] = Histogram(buckets, found["sum"], found["count"])
    return Page(gauges, histograms)


def queued_prompt_tokens(pods: Iterable[tuple[Page | None, Page | None]]) -> float | None:
    """Over (earlier, latest) pages of each prefill pod: waiting requests times their pod's mean
    prompt. None when any latest page lacks what it needs (a pod not measured is not zero load)."""
    total = 0.0
    for before, after in pods:
        if after is None or WAITING not in after.gauges or PROMPT_TOKENS not in after.histograms:
            return None
        prompts = after.histograms[PROMPT_TOKENS]
        recent = prompts.minus(before.histograms.get(PROMPT_TOKENS) if before else None)
        mean = recent.total / recent.count if recent.count > 0 else prompts.total / max(prompts.count, 1)
        total += after.gauges[WAITING] * mean
    return total


def mean_kv_usage(pages: Iterable[Page | None]) -> float | None:
    values = [page.gauges.get(KV_USAGE) if page else None for page in pages]
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)


def latency(name: str, pods: Iterable[tuple[Page | None, Page | None]]) -> float | None:
    """The 90th percentile of the histogram `name`'s observations between two scrapes, over every
    router pod's (earlier, latest) pages; None when a latest page lacks it or nothing was observed."""
    merged: Histogram | None = None
    for before, after in pods:
        if after is None or name not in after.histograms:
            return None
        recent = after.histograms[name].minus(before.histograms.get(name) if before else None)
        merged = recent if merged is None else merged.plus(recent)
        if merged is None:
            return None  # routers with other buckets: not summed
    return merged.quantile(QUANTILE) if merged else None


Scrapes = Sequence[tuple[Page | None, Page | None]]  # each pod's (earlier, latest) page


def signals_for(
    spec: AutoscalingSpec, prefill: Scrapes, decode: Scrapes, routers: Scrapes, now: float
) -> dict[Role, Signal | None]:
    """Each configured role's measure for its target, taken `now`; None where it cannot be measured
    (no pod, a page missing what it needs, no request between the scrapes for a latency)."""
    found: dict[Role, Signal | None] = {}
    if spec.prefill is not None:
        if spec.prefill.target.queued_prompt_tokens_per_replica is not None:
            value = queued_prompt_tokens(prefill) if prefill else None
        else:
            value = latency(TTFT_HISTOGRAM, routers) if routers else None
        found["prefill"] = None if value is None else Signal(value, now)
    if spec.decode is not None:
        if spec.decode.target.kv_cache_usage is not None:
            value = mean_kv_usage(after for _, after in decode)
        else:
            value = latency(ITL_HISTOGRAM, routers) if routers else None
        found["decode"] = None if value is None else Signal(value, now)
    return found
