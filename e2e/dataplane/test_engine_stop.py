"""A prefill engine stopped while a request's KV push still runs, as a roll stops one when a request
reached it after its preStop drain's last idle reading (issue 31): SIGTERM to the engine's main process,
as kubelet sends it, with decode held by SIGSTOP so that the push cannot finish first.

vLLM aborts what is in flight at SIGTERM unless --shutdown-timeout is set; an aborted push leaves decode
without the prompt's KV, and decode answers vLLM's `500 Internal server error` (the failure the node
tier's rolling test met about one full run in three). The operator renders --shutdown-timeout from the
grace period, so the engine finishes the push, then exits, and the client gets its answer."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e.dataplane.pipeline import Pipeline, counter, metrics_text, rendered_engine, wait_healthy
from e2e.dataplane.prompts import PIPELINE_MARKS, PROMPTS, completion, run_pipeline
from e2e.fixtures import wait_until
from e2e.processes import descendants

pytestmark = PIPELINE_MARKS

SENDS_IN_FLIGHT = "vllm:dllm_kv_sends_in_flight"
BLOCK = 32  # the sample's --block-size
WAIT_FOR_PREFILL_S = 60  # the sample's prefillWaitMs: how long decode waits for KV before it fails


@pytest.fixture(scope="module")
def pipeline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """The sample's pipeline, but each engine's model in a worker process apart from its engine core
    (vLLM's CPU default, which the sample turns off): the last test holds a step by stopping the
    worker while the engine core still takes requests and signals."""
    yield from run_pipeline(
        model, tmp_path_factory.mktemp("stop-logs"), "none", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    )


def test_the_rendered_engines_drain_rather_than_abort_at_sigterm() -> None:
    for role in ("prefill", "decode"):
        _, args = rendered_engine(role)
        assert int(args[args.index("--shutdown-timeout") + 1]) > 0, role


def test_prefill_stopped_with_a_push_in_flight_finishes_it_and_the_client_is_answered(
    pipeline: Pipeline,
) -> None:
    prefill, decode = pipeline.processes["prefill"], pipeline.processes["decode"]
    router_url = pipeline.processes["router"].url
    loaded_before = counter(metrics_text(decode.url), "vllm:external_prefix_cache_hits")
    prompt = PROMPTS[0]
    os.killpg(decode.process.pid, signal.SIGSTOP)  # the engine and its workers: nothing accepts the push
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(completion, router_url, prompt)
            wait_until(
                lambda: counter(metrics_text(prefill.url), SENDS_IN_FLIGHT) >= 1,
                120,
                "prefill answered and its push waits on the stopped decode",
            )
            os.kill(prefill.process.pid, signal.SIGTERM)  # PID 1 of the container: vLLM's API server
            wait_until(lambda: "shutdown triggered" in prefill.tail(200), 30, "prefill's shutdown to begin")
            os.killpg(decode.process.pid, signal.SIGCONT)
            status, body = answer.result(timeout=300)
    finally:
        os.killpg(decode.process.pid, signal.SIGCONT)
    assert status == 200, f"{body}\n--- prefill ---\n{prefill.tail(40)}\n--- decode ---\n{decode.tail(40)}"
    assert body["choices"][0]["text"], body
    # Decode loaded every full block of the prompt from the stopped prefill, and computed none of it.
    prompt_tokens = int(body["usage"]["prompt_tokens"])
    loaded = wait_until(
        lambda: counter(metrics_text(decode.url), "vllm:external_prefix_cache_hits") - loaded_before or None,
        10,
        "decode's external prefix-cache hits to grow",
    )
    assert loaded >= (prompt_tokens // BLOCK) * BLOCK > 0, (loaded, prompt_tokens)
    # Then prefill exited by itself, well within its grace period.
    assert prefill.process.wait(timeout=60) is not None
    assert "aborting in-flight requests" not in prefill.tail(400)


def engine_workers(pid: int) -> list[int]:
    """vLLM's worker processes under an engine's main process (their titles name them)."""
    return [child for child, name in descendants(pid).items() if "worker" in name.lower()]


def test_a_request_that_reaches_prefill_as_it_stops_is_run_by_another_prefill_or_refused_at_once(
    pipeline: Pipeline,
) -> None:
    """Issue 31's second cause, as a roll met it with two clients: SIGTERM reaches prefill's engine core
    while a step runs one prompt (its worker held by SIGSTOP), and a second prompt reaches the engine
    core after that. vLLM rejects a request added while shutting down and its API server answers it
    200 with finish_reason "abort"; the router used to take that for a prefill that ran and wait on
    decode, which waited prefillWaitMs for KV that never came and answered 500. Now the router takes
    the pod out and the prompt gets a clean 503 at once (this pipeline has no other prefill), while
    the prompt that was running is answered in full."""
    if not pipeline.processes["prefill"].alive():  # the test before stops it
        wait_healthy(pipeline.start_engine("prefill"))
    prefill, decode = pipeline.processes["prefill"], pipeline.processes["decode"]
    router_url = pipeline.processes["router"].url
    wait_until(lambda: completion(router_url, PROMPTS[3])[0] == 200, 60, "the router to serve again")
    workers = engine_workers(prefill.process.pid)
    assert workers, "no worker process under prefill's engine"
    waiting_before = counter(metrics_text(decode.url), "vllm:num_requests_waiting")
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(completion, router_url, prompt) for prompt in (PROMPTS[0], PROMPTS[2])]
            wait_until(
                lambda: counter(metrics_text(decode.url), "vllm:num_requests_waiting") >= waiting_before + 2,
                60,
                "decode waiting for both prompts' KV",
            )
            os.kill(prefill.process.pid, signal.SIGTERM)
            wait_until(
                lambda: "received signal=SIGTERM" in prefill.tail(400), 30, "prefill's engine core told"
            )
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
            started = time.monotonic()
            results = [answer.result(timeout=300) for answer in answers]
            took = time.monotonic() - started
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    logs = f"--- prefill ---\n{prefill.tail(60)}\n--- decode ---\n{decode.tail(30)}"
    statuses = sorted(status for status, _ in results)
    assert 500 not in statuses, f"{results}\n{logs}"
    assert 200 in statuses, f"{results}\n{logs}"
    for status, body in results:
        if status != 200:
            assert (status, body["error"]["type"]) == (503, "no_prefill"), body
    assert took < WAIT_FOR_PREFILL_S, f"an answer took {took:.0f}s: decode waited for KV\n{logs}"
