"""The GPU-cluster suite: the seed's Llama-2-70b topology on a real cluster with GPUs and RDMA.

Runs only against a cluster you name (it creates and deletes objects):
    DLLM_E2E_KUBECONFIG=~/.kube/gpu DLLM_E2E_ALLOW_CONTEXT=<its context> \\
    DLLM_GPU_SAMPLE=crds/samples/seed-llama2-70b.yaml .venv/bin/python -m pytest e2e/gpu -m gpu
The operator must already be installed there (helm install dllm charts/dllm-operator), and the sample's
prerequisites must exist in DLLM_GPU_NAMESPACE (default dllm-gpu-e2e): the hf-token Secret and the
hf-cache PersistentVolumeClaim. Skipped, with this message, when no such cluster is configured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.fixtures import Cluster, wait_until
from e2e.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not os.environ.get("DLLM_E2E_KUBECONFIG"),
        reason="no GPU cluster configured (set DLLM_E2E_KUBECONFIG and DLLM_E2E_ALLOW_CONTEXT)",
    ),
]
SAMPLE = Path(os.environ.get("DLLM_GPU_SAMPLE", ROOT / "crds" / "samples" / "seed-llama2-70b.yaml"))
NAMESPACE = os.environ.get("DLLM_GPU_NAMESPACE", "dllm-gpu-e2e")
TRANSPORT_LINE = re.compile(r"(?i)\b(rdma|tcp)\b.*transport|transport.*\b(rdma|tcp)\b")


@pytest.fixture(scope="module")
def deployed(cluster: Cluster) -> Iterator[str]:
    name = next(
        line.split(":", 1)[1].strip()
        for line in SAMPLE.read_text().splitlines()
        if line.strip().startswith("name:")
    )
    cluster.run("apply", "--server-side", "-n", NAMESPACE, "-f", str(SAMPLE))
    yield name
    if not os.environ.get("DLLM_GPU_KEEP"):
        cluster.run("delete", "-n", NAMESPACE, "-f", str(SAMPLE), "--wait=false", check=False)


def test_seed_topology_becomes_ready(cluster: Cluster, deployed: str) -> None:
    def ready() -> bool:
        cr = cluster.get_json("dllm", deployed, "-n", NAMESPACE)
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in cr.get("status", {}).get("conditions", [])
        )

    wait_until(ready, 45 * 60, f"{deployed} Ready (model download and load take minutes)", interval=10)


def test_completion_through_the_router_and_transport_used(cluster: Cluster, deployed: str) -> None:
    port = free_port()  # kubectl port-forward binds it later
    forward = subprocess.Popen(
        [cluster.kubectl_path, "port-forward", "-n", NAMESPACE, f"svc/{deployed}-router", f"{port}:8000"],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        output = forward.stdout
        assert output is not None
        wait_until(lambda: "Forwarding" in (output.readline() or ""), 30, "kubectl port-forward")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps(
                {
                    "model": "llama-2-70b",
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0,
                }
            ).encode(),
        )
        with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310
            body = json.loads(response.read())
        assert body["choices"][0]["text"].strip()
    finally:
        forward.terminate()
    # the StatefulSet's first pod (after a rollout of a kept deployment, not `-0`)
    decode = f"statefulset/{deployed}-decode"
    logs = cluster.run("logs", "-n", NAMESPACE, decode, "--tail=5000", check=False).stdout
    used = sorted({m.group(1) or m.group(2) for m in TRANSPORT_LINE.finditer(logs)})
    print(f"KV transfer transport reported by decode: {used or ['(not logged)']}")
    assert used, "decode's log names no Mooncake transport"
