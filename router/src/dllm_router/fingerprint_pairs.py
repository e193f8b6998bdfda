"""Prompts sent through a prefill/decode pair, by the two pods' KV fingerprints (issue 34).

The router pairs only equal fingerprints (pairing.py), so during a rollout this shows each version's
share of the traffic, and a pair of two different fingerprints would show here, never hide. Pods that
name no fingerprint count under "". Every pairing counts: a retry's, and the KV check's canaries
(which go through the same pairing). The label pairs are bounded: once MAX_PAIRS are kept (each
rollout adds one), pairs of fingerprints no pod names any more are dropped at the next scrape, and a
new pair that still finds no room counts under "other".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

MAX_PAIRS = 64
OTHER = ("other", "other")


class FingerprintPairs:
    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def count(self, prefill: str | None, decode: str | None) -> None:
        key = (prefill or "", decode or "")
        if key not in self.counts and len(self.counts) >= MAX_PAIRS:
            key = OTHER
        self.counts[key] += 1

    def families(self, current: set[str | None]) -> Iterator[Metric]:
        """The counts; when full, first dropping pairs whose fingerprints no pod in `current` names."""
        if len(self.counts) >= MAX_PAIRS:
            live = {fingerprint or "" for fingerprint in current}
            self.counts = Counter({k: n for k, n in self.counts.items() if k[0] in live or k[1] in live})
        family = CounterMetricFamily(
            "dllm_router_fingerprint_pairs",
            "Pairings of a prefill and a decode pod (prompts, retries and KV-check canaries), by each "
            "pod's KV fingerprint ('' where it names none); the router pairs only equal ones",
            labels=["prefill_fingerprint", "decode_fingerprint"],
        )
        for (prefill, decode), n in sorted(self.counts.items()):
            family.add_metric([prefill, decode], n)
        yield family
