"""One request, one trace: a client's W3C `traceparent` goes through the router to both engines, whose
vLLM exports its `llm_request` span over OTLP (as vLLM does it: `--otlp-traces-endpoint`), and a trace
viewer joining on the trace id sees the prefill leg and the decode leg as children of the client's span.
The spans are received by a real OTLP/HTTP receiver decoding OpenTelemetry's own messages
(otlp_receiver.py); the engines and the router are the real ones on the CPU pipeline.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.dataplane.otlp_receiver import Receiver, Span, receiving
from e2e.dataplane.pipeline import Pipeline, post_json
from e2e.dataplane.prompts import PIPELINE_MARKS, PROMPTS
from e2e.fixtures import wait_until

pytestmark = PIPELINE_MARKS


@pytest.fixture(scope="module")
def traced(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, Receiver]]:
    with receiving() as receiver:
        pipeline = Pipeline(
            model=model,
            logs=tmp_path_factory.mktemp("tracing"),
            engine_extra=("--otlp-traces-endpoint", receiver.url),
            # OTLP over HTTP (gRPC is vLLM's default); spans sent within a fifth of a second
            engine_env={
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            },
        )
        try:
            yield pipeline.start(), receiver
        finally:
            pipeline.stop()


def legs(receiver: Receiver, trace_id: str) -> list[Span] | None:
    """The trace's request spans, once there is one from each engine."""
    spans = [s for s in receiver.of_trace(trace_id) if s.name == "llm_request"]
    return spans if len({s.resource.get("vllm.process_id") for s in spans}) >= 2 else None


def test_one_request_is_one_trace_with_a_prefill_and_a_decode_leg(traced: tuple[Pipeline, Receiver]) -> None:
    pipeline, receiver = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0.0}
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": "traced-1"}
    status, answer = post_json(pipeline.processes["router"].url + "/v1/completions", body, headers=headers)
    assert status == 200, answer
    spans = wait_until(lambda: legs(receiver, trace_id), 60, "a span from each engine in the client's trace")
    assert len(spans) == 2, spans
    assert {s.parent_span_id for s in spans} == {parent_id}  # both children of the client's span
    # one leg generated the first token and stopped (prefill), the other all four (decode)
    assert sorted(s.attributes["gen_ai.usage.completion_tokens"] for s in spans) == [1, 4], spans
    assert all("traced-1" in s.attributes["gen_ai.request.id"] for s in spans), spans


def test_a_request_without_a_trace_is_still_one_trace_across_both_engines(
    traced: tuple[Pipeline, Receiver],
) -> None:
    pipeline, receiver = traced
    body = {"model": "tiny-llama", "prompt": PROMPTS[2], "max_tokens": 3, "temperature": 0.0}
    headers = {"X-Request-Id": "untraced-1"}
    status, answer = post_json(pipeline.processes["router"].url + "/v1/completions", body, headers=headers)
    assert status == 200, answer

    def joined() -> list[Span] | None:
        mine = [s for s in receiver.spans if "untraced-1" in str(s.attributes.get("gen_ai.request.id"))]
        return mine if len(mine) == 2 else None

    spans = wait_until(joined, 60, "a span from each engine for the request")
    assert spans[0].trace_id == spans[1].trace_id  # the router's new traceparent, on both legs
    assert spans[0].parent_span_id == spans[1].parent_span_id != ""
