"""The images built here reach the real node through the local registry, one changed layer at a time:
after a code change the node fetches the new layer, not the gigabytes under it (the engine's torch)."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e import node_images
from e2e.cluster import controlplane as cp
from e2e.cluster import node, registry

pytestmark = [pytest.mark.k8s, pytest.mark.node]
LAYERED = "localhost/dllm-test/layered:latest"  # one tag, so each run's build supersedes the last


def build_layered(context: Path) -> None:
    """The router image built here, plus one layer holding a file no other build has."""
    (context / "marker").write_text(str(uuid.uuid4()))
    (context / "Containerfile").write_text(f"FROM {node_images.ref('router')}\nCOPY marker /marker\n")
    built = subprocess.run(
        ["podman", "build", "--pull=never", "--quiet", "--tag", LAYERED, str(context)],
        capture_output=True, text=True, env=node_images.PODMAN_ENV, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr


@pytest.fixture
def layered(real_node: cp.Layout, tmp_path: Path) -> Iterator[Path]:
    """A first build loaded, so the router's layers under it came through the registry (on a machine
    that loaded the router by archive before, containerd held them in another form)."""
    build_layered(tmp_path)
    node_images.load(real_node, [LAYERED], log=lambda line: None)
    yield tmp_path
    node.ctr(real_node, "images", "rm", LAYERED)
    subprocess.run(["podman", "rmi", LAYERED], capture_output=True, env=node_images.PODMAN_ENV, check=False)


def blobs(real_node: cp.Layout) -> set[str]:
    return set(node.ctr(real_node, "content", "ls", "--quiet").split())


def test_a_rebuilt_image_moves_only_its_new_layer_into_the_node(real_node: cp.Layout, layered: Path) -> None:
    build_layered(layered)  # the same name, a new top layer: what a code change does to the engine image
    before = blobs(real_node)
    lines: list[str] = []
    node_images.load(real_node, [LAYERED], log=lines.append)
    assert lines == [f"    {LAYERED}: loaded into the node"]
    assert LAYERED in node.ctr(real_node, "images", "ls", "--quiet").split()
    # The manifest, the config and the one new layer; the layers under it were there already.
    assert len(blobs(real_node) - before) == 3
    # A second load finds the same build on the node and moves nothing.
    node_images.load(real_node, [LAYERED], log=lines.append)
    assert lines[-1] == f"    {LAYERED}: already on the node"
    # The registry ran only for the load, and only on 127.0.0.1.
    assert cp.read_pid(real_node, registry.COMPONENT) is None
    config = json.loads(registry.config_path(real_node).read_text())
    assert config["http"]["addr"] == f"127.0.0.1:{real_node.ports['image-registry']}"
