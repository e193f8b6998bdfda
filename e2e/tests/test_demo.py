"""`make demo` as a test, on the real node: the operator pod from its image, the CPU sample Ready through
real probes, and one chat completion through the router Service with decode's KV loaded over the wire."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e.fixtures import Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.slow, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DLLM_DEMO_NAMESPACE="demo-test")
    return subprocess.run([sys.executable, "-m", "e2e.demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200, check=False)  # fmt: skip


def test_demo_answers_through_the_router_service(cluster: Cluster) -> None:
    try:
        result = run_demo("up", "--timeout", "900")
        out = result.stdout
        assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
        assert "Ready=True" in out
        # The operator runs as a pod on the real node, from the image built here.
        assert re.search(r"dllm-dllm-operator-\S+\s+1/1\s+Running\s+\d+.*dllm-real-0", out), out
        assert re.search(r"answer:\s+'.+'", out), out
        loaded = re.search(
            r"decode loaded (\d+) prompt tokens of KV from prefill over Mooncake \((\d+) bytes\)", out
        )
        assert loaded is not None, out
        assert int(loaded.group(1)) >= 32  # at least one full block came over the wire
        assert int(loaded.group(2)) == int(loaded.group(1)) * 1024  # 2 layers x 2 KV heads x 64 x K,V x bf16
        assert re.search(r"curl -s http://10\.96\.\d+\.\d+:8000/v1/chat/completions", out), out
    finally:
        down = run_demo("down", "--keep-cluster")
    assert down.returncode == 0, down.stderr
    assert cluster.helm("list", "-n", "dllm-system", "-q").stdout.strip() == ""
    assert (
        cluster.run("get", "pods", "-n", "demo-test", "--ignore-not-found", "-o", "name").stdout.strip() == ""
    )
