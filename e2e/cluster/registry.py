"""A local image registry (Debian's docker-registry) that carries the images built here into the real
node's containerd, one changed layer at a time.

`podman save | ctr import` moved every layer of an image on each build: minutes for the engine image,
of which only the top layers change with the code. Through a registry, podman pushes only the layers
the registry lacks (its blob cache remembers which compressed blob holds which layer, and where it
went), and containerd fetches only the blobs it lacks. This is the local registry kind's users run.

It runs only while images load, on 127.0.0.1 at a port of the cluster's own block (layout.ports), its
storage in the cache beside the node's store (both outlive `down`).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from e2e.cluster import controlplane as cp

COMPONENT = "image-registry"  # its pid file and log in the state folder; `down` stops it too


def binary(layout: cp.Layout) -> Path:
    """Where build.sh unpacked the pinned Debian package's binary."""
    version = layout.versions["DOCKER_REGISTRY_VERSION"]
    return layout.cache / "bin" / f"docker-registry-v{version}" / "docker-registry"


def storage(layout: cp.Layout) -> Path:
    return layout.cache / "node-store" / "registry"


def config_path(layout: cp.Layout) -> Path:
    return layout.state / "registry.yml"


def _config(layout: cp.Layout, address: str) -> Path:
    """JSON, which is YAML: the registry's config.yml. No auth: it listens on 127.0.0.1 only, while a
    load runs."""
    config = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {
            "filesystem": {"rootdirectory": str(storage(layout) / "data")},
            "delete": {"enabled": True},
        },
        "http": {"addr": address},
    }
    path = config_path(layout)
    path.write_text(json.dumps(config))
    return path


def _answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running(layout: cp.Layout) -> Iterator[str]:
    """The registry serving for the block: yields its address (127.0.0.1:PORT); stopped after, and its
    unreferenced blobs collected (superseded builds of an image would otherwise pile up)."""
    executable = binary(layout)
    if not executable.exists():
        raise cp.ClusterError(f"{executable} is missing: run `make cluster-build`")
    address = f"127.0.0.1:{layout.ports['image-registry']}"
    config = _config(layout, address)
    cp.spawn(layout, COMPONENT, [str(executable), "serve", str(config)])
    try:
        cp.wait_for(lambda: _alive(layout) and _answers(address), 30, f"the image registry on {address}")
        yield address
    finally:
        cp.stop_component(layout, COMPONENT)
    collected = subprocess.run(
        [str(executable), "garbage-collect", "--delete-untagged", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False, timeout=600,
    )  # fmt: skip
    if collected.returncode != 0:
        raise cp.ClusterError(f"the image registry's garbage collection failed: {collected.stderr.strip()}")


def _alive(layout: cp.Layout) -> bool:
    pid = cp.read_pid(layout, COMPONENT)
    if pid is None or not cp.pid_alive(pid):
        log = layout.log(COMPONENT).read_text(errors="replace")[-2000:]
        raise cp.ClusterError(f"the image registry exited: {log}")
    return True
