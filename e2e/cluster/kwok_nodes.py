"""kubectl against the local control plane, and kwok's fake GPU/RDMA nodes (their stages, their Node
objects), with the wait for the controllers that the first pods need."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

from e2e.cluster.layout import ClusterError, Layout, log, wait_for

GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/hca_shared_devices_a"


def kubectl(layout: Layout, *args: str, input_text: str | None = None) -> str:
    result = subprocess.run(
        [str(layout.kubectl), f"--kubeconfig={layout.kubeconfig}", *args],
        input=input_text,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def render_stages(layout: Layout) -> None:
    """Standalone kwok has no default stages: render the module's own 'fast' ones (Running, Ready)."""
    stages = kubectl(layout, "kustomize", str(layout.kwok_stages / "fast"))
    (layout.state / "stages.yaml").write_text(stages)


def fake_node(name: str, zone: str) -> dict[str, object]:
    capacity = {
        "cpu": "96",
        "memory": "1024Gi",
        "pods": "110",
        "ephemeral-storage": "2Ti",
        GPU_RESOURCE: "8",
        RDMA_RESOURCE: "64",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "type": "kwok", "topology.kubernetes.io/zone": zone,
                "node.kubernetes.io/instance-type": "gpu-8x-h100",
                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "feature.node.kubernetes.io/rdma.available": "true",
                "feature.node.kubernetes.io/pci-15b3.present": "true",
            },
        },
        "spec": {"taints": []},
        "status": {"capacity": capacity, "allocatable": capacity, "nodeInfo": {
            "kubeletVersion": "fake", "architecture": "amd64", "operatingSystem": "linux"}},
    }  # fmt: skip


def node_names(count: int) -> Iterator[tuple[str, str]]:
    for index in range(count):
        yield f"gpu-node-{index}", f"zone-{'ab'[index % 2]}"


def create_nodes(layout: Layout, count: int, start: float) -> None:
    for name, zone in node_names(count):
        kubectl(layout, "apply", "--server-side", "-f", "-", input_text=json.dumps(fake_node(name, zone)))
    kubectl(layout, "wait", "--for=condition=Ready", "node", "--all", "--timeout=120s")
    log(f"{count} fake GPU nodes Ready (8 x {GPU_RESOURCE}, {RDMA_RESOURCE})", start)


def wait_default_service_account(layout: Layout, start: float) -> None:
    def has_sa() -> bool:
        try:
            kubectl(layout, "get", "serviceaccount", "default", "-n", "default")
            return True
        except ClusterError:
            return False

    wait_for(has_sa, 60, "the default ServiceAccount (controller-manager's token controller)")
    log("controllers running", start)
