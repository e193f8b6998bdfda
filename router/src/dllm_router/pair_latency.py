"""Latencies per prefill/decode pair: time to first token and its parts, and inter-token latency.

The router's own histograms (metrics.py) sum over every pair; a slow pair (a decode pod on a busy
node, a pair whose KV crosses a slow link) hides in them. These are the same observations kept per
pair of pod names, for the pairs of pods the router still knows (a pair is dropped when a pod leaves).

- `dllm_router_pair_prefill_seconds`: the prefill call, from sending to its answer;
- `dllm_router_pair_decode_first_byte_seconds`: from prefill's answer to decode's first byte (the KV
  transfer and decode's first step; the split between them is not visible from here);
- `dllm_router_pair_ttft_seconds`: from the request to the client's first byte;
- `dllm_router_pair_inter_token_seconds`: streamed answers only, the time between two events
  (tokens) of decode's stream, each chunk's gap shared by the events it carries.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from prometheus_client.core import HistogramMetricFamily, Metric

from dllm_router.histogram import Histogram

Kind = Literal["prefill", "decode_first_byte", "ttft", "inter_token"]
_DOCS: dict[Kind, str] = {
    "prefill": "Prefill call duration, per prefill/decode pair",
    "decode_first_byte": "From prefill's answer to decode's first byte (KV and first step), per pair",
    "ttft": "Time to the first byte for the client, per prefill/decode pair",
    "inter_token": "Time between two events of decode's stream (streamed answers), per pair",
}


class PairLatency:
    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], dict[Kind, Histogram]] = {}

    def observe(self, kind: Kind, prefill: str, decode: str, seconds: float, count: int = 1) -> None:
        histograms = self._pairs.get((prefill, decode))
        if histograms is None:
            histograms = self._pairs[(prefill, decode)] = {k: Histogram() for k in _DOCS}
        histogram = histograms[kind]
        for _ in range(count):
            histogram.observe(seconds)

    def families(self, known: set[str]) -> Iterator[Metric]:
        """One histogram family per kind, with a child per pair whose pods are both still `known`."""
        self._pairs = {pair: h for pair, h in self._pairs.items() if pair[0] in known and pair[1] in known}
        for kind, doc in _DOCS.items():
            family = HistogramMetricFamily(
                f"dllm_router_pair_{kind}_seconds", doc, labels=["prefill", "decode"]
            )
            for (prefill, decode), histograms in sorted(self._pairs.items()):
                buckets, total = histograms[kind].buckets()
                family.add_metric([prefill, decode], buckets, total)
            yield family
