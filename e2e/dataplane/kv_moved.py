"""The proof that decode loaded a prompt's KV instead of computing it, from decode's own /metrics, and
the figures the layout says that proof must show.

vLLM counts the prompt tokens a KV connector provided (`vllm:external_prefix_cache_hits`); the dllm
connector counts the bytes it received, as the cache holds them and as they crossed the wire
(`vllm:dllm_kv_bytes{kind=kv|wire}`). Decode loads every token of a prompt (vLLM then recomputes only
its last), and the connector moves whole blocks, the last one partly filled.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from e2e.dataplane.pipeline import MetricAbsent, counter, metrics_text, sample

_PAUSE = threading.Event()

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4}


@dataclass(frozen=True)
class Moved:
    """Decode's counts: prompt tokens loaded from prefill, KV bytes received, bytes on the wire."""

    tokens: float
    kv_bytes: float
    wire_bytes: float

    def __sub__(self, before: Moved) -> Moved:
        return Moved(
            self.tokens - before.tokens, self.kv_bytes - before.kv_bytes, self.wire_bytes - before.wire_bytes
        )


def moved(decode_metrics: str) -> Moved:
    """What decode's /metrics says it loaded so far (every metric must be there: absent is an error)."""
    return Moved(
        tokens=counter(decode_metrics, "vllm:external_prefix_cache_hits"),
        kv_bytes=counter(decode_metrics, "vllm:dllm_kv_bytes", kind="kv"),
        wire_bytes=counter(decode_metrics, "vllm:dllm_kv_bytes", kind="wire"),
    )


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """K and V of every layer and KV head of one token, in the served dtype; with MLA (a config with
    kv_lora_rank), the one latent per layer: kv_lora_rank + qk_rope_head_dim values."""
    config = json.loads((model / "config.json").read_text())
    if config.get("kv_lora_rank"):
        latent = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        return int(config["num_hidden_layers"]) * latent * DTYPE_BYTES[dtype]
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    per_value = DTYPE_BYTES[dtype]
    return 2 * int(config["num_hidden_layers"]) * int(config["num_key_value_heads"]) * head_dim * per_value


def expected(prompt_tokens: list[int], block_size: int, per_token: int) -> Moved:
    """What decode must count for these prompts with codec none: every prompt token loaded, and the
    bytes of each prompt's blocks (its last block whole, as the cache holds it)."""
    blocks = sum(math.ceil(tokens / block_size) for tokens in prompt_tokens)
    kv = blocks * block_size * per_token
    return Moved(tokens=float(sum(prompt_tokens)), kv_bytes=float(kv), wire_bytes=float(kv))


def for_sample(model: Path, prompt_tokens: list[int], compression: str = "none") -> Moved:
    """`expected` with the CPU sample's block size and dtype (crds/samples/cpu-tiny.yaml)."""
    spec = sample(compression).spec.model
    assert spec.block_size is not None, "the CPU sample names its block size"
    return expected(prompt_tokens, spec.block_size, kv_bytes_per_token(model, spec.dtype))


def canary_totals(router_metrics: str, role: str, pod: str | None = None) -> dict[str, float]:
    """What the router's KV check added to the counters of the engines of `role` (or of one `pod`,
    host:port) so far, by kind; the router must export the family, even empty (absent is an error)."""
    families = {family.name: family for family in text_string_to_metric_families(router_metrics)}
    family = families.get("dllm_router_kv_check_engine")
    if family is None:
        raise MetricAbsent("no dllm_router_kv_check_engine on the router's /metrics")
    totals = {"requests": 0.0, "loaded_tokens": 0.0, "kv_bytes": 0.0, "wire_bytes": 0.0}
    for point in family.samples:
        labels = point.labels
        if labels.get("role") == role and pod in (None, labels.get("pod")) and labels.get("kind") in totals:
            totals[labels["kind"]] += point.value
    return totals


def canaries(router_metrics: str, pod: str | None = None) -> Moved:
    """What the router's canaries loaded into decode (one pod, or all): they count in its counters too."""
    totals = canary_totals(router_metrics, "decode", pod)
    return Moved(totals["loaded_tokens"], totals["kv_bytes"], totals["wire_bytes"])


def at(decode_url: str, router_url: str | None = None, *, one_decode: bool = False, tries: int = 50) -> Moved:
    """Decode's counters, less what the router's canaries put there: read while no canary runs and
    its totals hold still, so the two readings agree. The router names decode by its pod address,
    which is `decode_url`'s, unless decode is reached through another address (a published port):
    `one_decode` then counts the canaries of every decode pod the router knows, the one there is."""
    pod = None if one_decode else decode_url.split("://", 1)[-1]
    if router_url is None:
        return moved(metrics_text(decode_url))
    for _ in range(tries):
        first = metrics_text(router_url)
        decode = moved(metrics_text(decode_url))
        second = metrics_text(router_url)
        idle = (
            counter(first, "dllm_router_kv_check_in_flight")
            == counter(second, "dllm_router_kv_check_in_flight")
            == 0
        )
        settled = canaries(second, pod)
        if idle and canaries(first, pod) == settled:
            return decode - settled
        _PAUSE.wait(0.2)  # poll interval of a bounded wait: a canary is a few tokens
    raise NotMoved(f"the router's KV check never held still over {tries} readings")


class NotMoved(AssertionError):
    """Decode's counters did not move by what the layout says (the message gives both)."""


def wait_for(
    decode_url: str,
    before: Moved,
    want: Moved,
    timeout: float = 10,
    router_url: str | None = None,
    *,
    one_decode: bool = False,
) -> Moved:
    """Decode's counters (less the router's canaries, given `router_url`: see `at`), moved since
    `before` by exactly `want`: vLLM publishes an engine's stats a moment after they change, so this
    polls for at most `timeout` seconds; NotMoved if they never do."""
    deadline = time.monotonic() + timeout
    while (
        got := at(decode_url, router_url, one_decode=one_decode) - before
    ) != want and time.monotonic() < deadline:
        _PAUSE.wait(0.2)  # poll interval of a bounded wait
    if got != want:
        raise NotMoved(f"decode's own counters show {got}, where the prompts' KV is {want}")
    return got
