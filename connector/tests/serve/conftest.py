"""Shared fixtures for dllm-serve: the seed's two engines as the operator renders them, and a vLLM double."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The seed (shared/seed, shared/docs/api.md): Llama-2-70b, TP 4, Mooncake, fp8, KV port 50051.
SEED_PREFILL_ENV: dict[str, str] = {
    "VLLM_KV_CONNECTOR": "mooncake",
    "VLLM_KV_ROLE": "prefill",
    "VLLM_KV_DECODE_IP": "llama2-70b-decode",
    "VLLM_KV_DECODE_PORT": "50051",
    "VLLM_KV_LISTEN_PORT": "50051",
    "VLLM_KV_BUFFER_SIZE_GB": "4",
    "VLLM_KV_COMPRESSION": "fp8",
    "VLLM_KV_TRANSFER_THRESHOLD": "1024",
    "VLLM_KV_TRANSFER_TIMEOUT_MS": "5000",
    "VLLM_KV_HOLD_SECONDS": "480",
    "VLLM_KV_ASYNC": "true",
    "VLLM_KV_LOAD_FAILURE_POLICY": "fail",
    "MOONCAKE_PROTOCOL": "tcp",
    "VLLM_HOST_IP": "10.0.0.5",
    "DLLM_ENGINE_ID": "llama2-70b-prefill-0",
}
SEED_DECODE_ENV: dict[str, str] = {
    "VLLM_KV_CONNECTOR": "mooncake",
    "VLLM_KV_ROLE": "decode",
    "VLLM_KV_LISTEN_PORT": "50051",
    "VLLM_KV_BUFFER_SIZE_GB": "8",
    "VLLM_KV_COMPRESSION": "fp8",
    "VLLM_KV_TRANSFER_THRESHOLD": "1024",
    "VLLM_KV_TRANSFER_TIMEOUT_MS": "5000",
    "VLLM_KV_PREFILL_WAIT_MS": "60000",
    "VLLM_KV_ASYNC": "true",
    "VLLM_KV_LOAD_FAILURE_POLICY": "fail",
    "MOONCAKE_PROTOCOL": "tcp",
    "VLLM_HOST_IP": "10.0.0.6",
    "DLLM_ENGINE_ID": "llama2-70b-decode-0",
}
SEED_PREFILL_ARGS = [
    "--model", "meta-llama/Llama-2-70b", "--tensor-parallel-size", "4",
    "--max-num-seqs", "64", "--max-num-batched-tokens", "8192", "--port", "8000",
]  # fmt: skip
SEED_DECODE_ARGS = [
    "--model", "meta-llama/Llama-2-70b", "--tensor-parallel-size", "4",
    "--max-num-seqs", "256", "--max-num-batched-tokens", "2048", "--no-enable-chunked-prefill",
    "--port", "8001",
]  # fmt: skip

_FAKE_VLLM = '''#!{python}
"""TEST DOUBLE standing in for vLLM's `vllm` CLI: it only records that it was started (argv and the
Mooncake env it got) in $FAKE_VLLM_MARKER, so a test can tell whether dllm-serve started "vLLM"."""
import json, os, sys
names = ("MC_FORCE_TCP", "MC_TCP_BIND_ADDRESS", "VLLM_KV_ROLE")
with open(os.environ["FAKE_VLLM_MARKER"], "w") as out:
    json.dump({{"argv": sys.argv[1:], "env": {{n: os.environ.get(n) for n in names}}}}, out)
'''


@dataclass(frozen=True)
class FakeVllm:
    """Where the vLLM double lives and where it leaves its marker."""

    bin_dir: Path
    marker: Path

    def started(self) -> bool:
        return self.marker.exists()

    def record(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.marker.read_text())
        return loaded


@pytest.fixture
def fake_vllm(tmp_path: Path) -> FakeVllm:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "vllm"
    program.write_text(_FAKE_VLLM.format(python=sys.executable))
    program.chmod(0o755)
    return FakeVllm(bin_dir=bin_dir, marker=tmp_path / "vllm-started.json")


def _run_serve(
    args: Sequence[str], env: Mapping[str, str], fake: FakeVllm | None = None
) -> subprocess.CompletedProcess[str]:
    """Run dllm-serve in a clean environment: only PATH (the double first), PYTHONPATH and `env`."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    full_env = {"PATH": f"{fake.bin_dir}{os.pathsep}{path}" if fake else path, **env}
    if fake is not None:
        full_env["FAKE_VLLM_MARKER"] = str(fake.marker)
    if "PYTHONPATH" in os.environ:
        full_env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        [sys.executable, "-m", "dllm_connector.serve", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


RunServe = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def run_serve() -> RunServe:
    """run_serve(args, env, fake=None): dllm-serve as a child process (it execs, so never in-process)."""
    return _run_serve


@dataclass(frozen=True)
class Engine:
    env: dict[str, str]
    args: list[str]


@pytest.fixture
def seed_prefill() -> Engine:
    return Engine(env=dict(SEED_PREFILL_ENV), args=list(SEED_PREFILL_ARGS))


@pytest.fixture
def seed_decode() -> Engine:
    return Engine(env=dict(SEED_DECODE_ENV), args=list(SEED_DECODE_ARGS))
