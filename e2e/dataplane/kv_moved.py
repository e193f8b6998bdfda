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

from e2e.dataplane.pipeline import counter, metrics_text, sample

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
    """K and V of every layer and KV head of one token, in the served dtype."""
    config = json.loads((model / "config.json").read_text())
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


class NotMoved(AssertionError):
    """Decode's counters did not move by what the layout says (the message gives both)."""


def wait_for(decode_url: str, before: Moved, want: Moved, timeout: float = 10) -> Moved:
    """Decode's counters, moved since `before` by exactly `want`: vLLM publishes an engine's stats a
    moment after they change, so this polls for at most `timeout` seconds; NotMoved if they never do."""
    deadline = time.monotonic() + timeout
    while (got := moved(metrics_text(decode_url)) - before) != want and time.monotonic() < deadline:
        _PAUSE.wait(0.2)  # poll interval of a bounded wait
    if got != want:
        raise NotMoved(f"decode's own counters show {got}, where the prompts' KV is {want}")
    return got
