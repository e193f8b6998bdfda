"""The real PD pipeline on CPU with fp8 and int8 KV on the wire (test_pipeline.py has the pipeline with
none): compression changes the KV decode attends to, so tokens may differ from one engine's; how much
is measured, and held above floors that KV decoded with wrong scales would not reach. Each pipeline
runs alone (two cores): test_pipeline.py's has stopped at the end of its module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e.dataplane.pipeline import counter, metrics_text
from e2e.dataplane.prompts import (
    COMPRESSED_FIRST_LOGPROB_BOUND,
    PIPELINE_MARKS,
    PROMPTS,
    completion,
    run_pipeline,
    tokens_and_logprobs,
)

pytestmark = PIPELINE_MARKS


@pytest.mark.parametrize("compression", ["fp8", "int8"])
def test_compressed_kv_difference_is_measured(
    model: Path, reference: dict[str, Any], compression: str, tmp_path: Path
) -> None:
    """fp8/int8 change the KV decode attends to, so tokens may differ from one engine: measure how much.

    The decoded tokens are all computed by decode on the transferred (compressed) KV, the first one included.
    """
    for run in run_pipeline(model, tmp_path, compression):
        decode = run.processes["decode"]
        loaded_before = counter(metrics_text(decode.url), "vllm:external_prefix_cache_hits")
        agree, total, first_diffs = 0, 0, []
        for prompt in PROMPTS:
            status, body = completion(run.processes["router"].url, prompt)
            assert status == 200, body
            tokens, logprobs = tokens_and_logprobs(body)
            want_tokens, want_logprobs = reference[prompt]
            agree += sum(a == b for a, b in zip(tokens, want_tokens, strict=True))
            total += len(tokens)
            if tokens[0] == want_tokens[0]:
                first_diffs.append(abs(logprobs[0] - want_logprobs[0]))
        loaded = counter(metrics_text(decode.url), "vllm:external_prefix_cache_hits") - loaded_before
        worst = max(first_diffs, default=float("nan"))
        print(
            f"\ncompression {compression}: {agree}/{total} tokens equal to one engine; first token equal on "
            f"{len(first_diffs)}/{len(PROMPTS)} prompts, max |logprob diff| there {worst:.4f}"
        )
        assert loaded > 0, "decode recomputed instead of loading the compressed KV"
        # Floors well under what both codecs measure (docs/benchmarks.md) and far above what KV decoded
        # with wrong scales gives: a third of the tokens, the first token on half the prompts, and
        # there within a nat of one engine's log-probability.
        assert agree >= total // 3, f"{agree}/{total} tokens equal to one engine"
        assert len(first_diffs) >= len(PROMPTS) // 2, f"first token equal on {len(first_diffs)}"
        assert worst <= COMPRESSED_FIRST_LOGPROB_BOUND
