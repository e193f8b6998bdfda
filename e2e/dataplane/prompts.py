"""What the CPU pipeline tests send (the prompts, greedy, with log-probabilities) and how they read the
answers; and a pipeline started for the length of a `for` (test_pipeline*.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from e2e.dataplane.pipeline import Pipeline, post_json

# The marks of the modules that run a pipeline: engines on both cores for minutes, and the engines'
# empty compile cache (conftest.py).
PIPELINE_MARKS = [
    pytest.mark.dataplane,
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("cold_compile_cache"),
]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Disaggregated prefill sends the KV cache from one engine to another; ",
    "0123456789 abcdefghij KLMNOPQRST " * 2,
    "ab",
]
ONE_TOKEN_PROMPT = "a"
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 0.02
COMPRESSED_FIRST_LOGPROB_BOUND = 1.0


def completion(url: str, prompt: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        **extra,
    }
    return post_json(f"{url}/v1/completions", body)


def tokens_and_logprobs(response: dict[str, Any]) -> tuple[list[str], list[float]]:
    logprobs = response["choices"][0]["logprobs"]
    return list(logprobs["tokens"]), [float(x) for x in logprobs["token_logprobs"]]


Answers = dict[str, tuple[list[str], list[float]]]  # prompt -> greedy tokens and their logprobs


def greedy_answers(url: str, prompts: list[str]) -> Answers:
    """An engine's (or the router's) greedy answer to each prompt."""
    answers = {}
    for prompt in prompts:
        status, body = completion(url, prompt)
        assert status == 200, body
        answers[prompt] = tokens_and_logprobs(body)
    return answers


def worst_logprob_gap(url: str, reference: Answers) -> float:
    """The largest log-probability difference from `reference` over its prompts, after asserting the
    tokens equal."""
    worst = 0.0
    for prompt, (tokens, logprobs) in greedy_answers(url, list(reference)).items():
        want_tokens, want_logprobs = reference[prompt]
        assert tokens == want_tokens, f"prompt {prompt[:30]!r}"
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)))
    return worst


def run_pipeline(
    model: Path, logs: Path, compression: str, engine_env: Mapping[str, str] | None = None
) -> Iterator[Pipeline]:
    """The sample's pipeline, started, stopped when the caller is done (`engine_env`: more environment
    for both engines)."""
    pipeline = Pipeline(model=model, logs=logs, compression=compression, engine_env=engine_env or {})
    try:
        yield pipeline.start()
    finally:
        pipeline.stop()
