"""`make demo`'s flow as a test: chart installed, operator as the chart's identity, sample Ready."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.fixtures import Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DLLM_DEMO_NAMESPACE="demo-test")
    return subprocess.run([sys.executable, "-m", "e2e.demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip


def test_demo_reaches_ready_and_shows_the_kv_env(cluster: Cluster) -> None:
    try:
        result = run_demo("up", "--timeout", "120")
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert "Ready=True" in out
        assert "tiny-cpu   1/1       1/1      True    mooncake" in out
        for name in (
            "VLLM_KV_CONNECTOR=mooncake",
            "VLLM_KV_ROLE=prefill",
            "VLLM_KV_ROLE=decode",
            "VLLM_KV_DECODE_IP=tiny-cpu-decode",
            "VLLM_KV_LISTEN_PORT=50051",
            "MOONCAKE_PROTOCOL=tcp",
        ):
            assert name in out
        assert "system:serviceaccount:dllm-system:dllm-dllm-operator" in out
    finally:
        down = run_demo("down", "--keep-cluster")
    assert down.returncode == 0, down.stderr
    assert cluster.helm("list", "-n", "dllm-system", "-q").stdout.strip() == ""
