"""The autoscaler's signals, read from metrics pages, pure (issue 36).

Two scrapes of the same pages, a scrape interval apart, give each role's measure (decide.Signal):

- prefill, queued prompt tokens: over prefill pods, the requests waiting (vLLM's
  `vllm:num_requests_waiting`) times the mean prompt of the requests that pod finished between the
  scrapes (`vllm:request_prompt_tokens`), or over its life when it finished none;
- decode, KV-cache usage: the mean of decode pods' `vllm:kv_cache_usage_perc`;
- time to first token and inter-token latency: the 90th percentile of the observations between the
  scrapes, from the router's histograms (`dllm_router_ttft_seconds`, and
  `dllm_router_pair_inter_token_seconds` summed over its pairs); 0 when the router is idle: it
  answered no request between the scrapes (`dllm_router_requests`) and has none in flight on any pod
  (`dllm_router_inflight`). An idle router keeps no one waiting, and its roles must be able to scale
  down; a busy one whose requests gave no observation (unstreamed answers give no inter-token time)
  gives no value.

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
INFLIGHT = "dllm_router_inflight"
ANSWERED = "dllm_router_requests"
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


LabelSet = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Page:
    """The values of one metrics page the autoscaler reads (absent: not on the page): gauges over
    their label sets, histograms per label set (the router drops a pair's series when a pod goes, so
    differences are taken per series, never of sums)."""

    gauges: Mapping[str, float]
    histograms: Mapping[str, Mapping[LabelSet, Histogram]]

    def merged(self, name: str) -> Histogram | None:
        """Every series of histogram `name` together (None: absent, or series with other buckets)."""
        return _merge(self.histograms.get(name, {}).values()) if name in self.histograms else None

    def since(self, name: str, before: Page | None) -> Histogram | None:
        """What histogram `name` observed since `before` (each series against its own earlier value)."""
        if name not in self.histograms:
            return None
        earlier = before.histograms.get(name, {}) if before else {}
        return _merge(h.minus(earlier.get(labels)) for labels, h in self.histograms[name].items())


def _merge(histograms: Iterable[Histogram]) -> Histogram | None:
    merged: Histogram | None = None
    for histogram in histograms:
        merged = histogram if merged is None else merged.plus(histogram)
        if merged is None:
            return None
    return merged if merged is not None else Histogram((), 0.0, 0.0)


def read_page(text: str) -> Page | None:
    """The page's gauges and histograms of the names above; None when it does not parse, or holds a
    value that is not a finite, non-negative number."""
    gauges: dict[str, float] = {}
    parts: dict[str, dict[LabelSet, dict[float | str, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            values = [sample.value for sample in family.samples]
            if not all(math.isfinite(v) and v >= 0 for v in values):
                return None
            if family.name == WAITING:
                gauges[WAITING] = sum(values)  # each data-parallel engine's queue adds up
            elif family.name == KV_USAGE and values:
                gauges[KV_USAGE] = sum(values) / len(values)  # a usage share: the engines' mean
            elif family.name == INFLIGHT:
                gauges[INFLIGHT] = sum(values)  # over both roles' pods
            elif family.name == ANSWERED:
                gauges[ANSWERED] = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name in (PROMPT_TOKENS, TTFT_HISTOGRAM, ITL_HISTOGRAM):
                for sample in family.samples:
                    labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                    found = parts.setdefault(family.name, {}).setdefault(labels, {})
                    if sample.name.endswith("_bucket"):
                        bound = float(sample.labels["le"])
                        if math.isnan(bound):
                            return None
                        found[bound] = sample.value
                    elif sample.name.endswith(("_sum", "_count")):
                        found[sample.name.rsplit("_", 1)[-1]] = sample.value
    except (ValueError, KeyError, TypeError):
        return None
    histograms: dict[str, dict[LabelSet, Histogram]] = {}
    for name, series in parts.items():
        histograms[name] = {}
        for labels, found in series.items():
            bounds = sorted(key for key in found if isinstance(key, float))
            if bounds and "sum" in found and "count" in found:
                buckets = tuple((bound, found[bound]) for bound in bounds)
                histograms[name][labels] = Histogram(buckets, found["sum"], found["count"])
    return Page(gauges, histograms)


def queued_prompt_tokens(pods: Iterable[tuple[Page | None, Page | None]]) -> float | None:
    """Over (earlier, latest) pages of each prefill pod: waiting requests times their pod's mean
    prompt (of those finished between the pages, else over its life). None when any latest page lacks
    what it needs (a pod not measured is not zero load)."""
    total = 0.0
    for before, after in pods:
        prompts = after.merged(PROMPT_TOKENS) if after else None
        recent = after.since(PROMPT_TOKENS, before) if after else None
        if after is None or WAITING not in after.gauges or prompts is None or recent is None:
            return None
        waiting = after.gauges[WAITING]
        if recent.count > 0:
            total += waiting * recent.total / recent.count
        elif prompts.count > 0:
            total += waiting * prompts.total / prompts.count
        elif waiting > 0:
            return None  # requests wait where none ever finished: their length is not known, nor zero
    return total


def mean_kv_usage(pages: Iterable[Page | None]) -> float | None:
    values = [page.gauges.get(KV_USAGE) if page else None for page in pages]
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)


def idle(before: Page | None, after: Page) -> bool:
    """The router answered nothing between the two pages and has nothing in flight now."""
    if before is None or not all(k in p.gauges for p in (before, after) for k in (ANSWERED, INFLIGHT)):
        return False
    return after.gauges[ANSWERED] == before.gauges[ANSWERED] and after.gauges[INFLIGHT] == 0


def latency(name: str, pods: Iterable[tuple[Page | None, Page | None]]) -> float | None:
    """The 90th percentile of the histogram `name`'s observations between two scrapes, over every
    router pod's (earlier, latest) pages; 0 when nothing was observed and every router was idle
    (`idle`); None when a latest page lacks the histogram, or nothing was observed of a busy router
    (a load not measured is not zero)."""
    recent: list[Histogram] = []
    quiet = True
    for before, after in pods:
        since = after.since(name, before) if after else None
        if after is None or since is None:
            return None
        recent.append(since)
        quiet = quiet and idle(before, after)
    merged = _merge(recent)
    if merged is None:
        return None
    if merged.count > 0:
        return merged.quantile(QUANTILE)
    return 0.0 if quiet else None


Scrapes = Sequence[tuple[Page | None, Page | None]]  # each pod's (earlier, latest) page


def signals_for(
    spec: AutoscalingSpec, prefill: Scrapes, decode: Scrapes, routers: Scrapes, now: float
) -> dict[Role, Signal | None]:
    """Each configured role's measure for its target, taken `now`; None where it cannot be measured
    (no pod, a page missing what it needs, a busy router that observed no latency)."""
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
