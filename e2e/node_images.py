"""The images `make images` built, loaded into the real node's containerd (nothing can be pulled here).

An image goes from podman through a local registry (e2e/cluster/registry.py) into containerd once per
build, only the layers the other side lacks: after a code change, the engine image's top layers, not
its gigabytes of torch. containerd's store outlives `down`, and a stamp in it records the podman image
id loaded, so a warm run (a later `up` included) loads nothing.

A first load takes minutes (the vllm-cpu image is several GB): the test session starts it in
the background as soon as the node is up (`preload`), while the tiers that need no image run. A lock in
the store makes a second loader (`make demo`'s, in another process) wait for it and then find the stamp.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from e2e.cluster import controlplane as cp
from e2e.cluster import node, registry

ROOT = Path(__file__).resolve().parents[1]
PREFIX = os.environ.get("DLLM_IMAGE_PREFIX", "localhost/dllm")
IMAGES = ("operator", "router", "vllm-cpu")
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "images" / "containers.conf")}


def ref(name: str) -> str:
    return f"{PREFIX}/{name}:dev"


def podman_id(reference: str) -> str:
    result = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", reference],
        capture_output=True, text=True, env=PODMAN_ENV, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise cp.ClusterError(f"{reference} is not built: run `make images` ({result.stderr.strip()})")
    return result.stdout.strip()


def _stamp(layout: cp.Layout, reference: str) -> Path:
    return node.paths_of(layout).store / "dllm-loaded" / reference.replace("/", "_").replace(":", "_")


def _in_containerd(layout: cp.Layout, reference: str) -> bool:
    return reference in node.ctr(layout, "images", "ls", "-q").split()


@contextmanager
def _only_loader(layout: cp.Layout) -> Iterator[None]:
    """One loader at a time on this node, across processes (released when its holder exits, too)."""
    lock = node.paths_of(layout).store / "dllm-loaded" / ".lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _loaded(layout: cp.Layout, reference: str, image_id: str) -> bool:
    stamp = _stamp(layout, reference)
    return stamp.exists() and stamp.read_text() == image_id and _in_containerd(layout, reference)


def _push_and_pull(layout: cp.Layout, reference: str, image_id: str, registry_address: str) -> None:
    """Through the registry: podman pushes only the layers it lacks, ctr fetches only the blobs
    containerd lacks. Layers as zstd, which containerd unpacks natively and with less CPU than gzip."""
    pushed = f"{registry_address}/{reference.split('/', 1)[1]}"
    push = subprocess.run(
        ["podman", "push", "--quiet", "--tls-verify=false", "--format=oci", "--compression-format=zstd",
         reference, pushed],
        capture_output=True, text=True, env=PODMAN_ENV, check=False, timeout=1800,
    )  # fmt: skip
    if push.returncode != 0:
        raise cp.ClusterError(f"podman push {reference} to the local registry failed: {push.stderr.strip()}")
    # --local: ctr fetches, as containerd lives in the node's network namespace, away from 127.0.0.1.
    node.ctr(layout, "images", "pull", "--local", "--plain-http", "--snapshotter=overlayfs",
             "--platform=linux/amd64", pushed)  # fmt: skip
    node.ctr(layout, "images", "tag", "--force", pushed, reference)
    node.ctr(layout, "images", "rm", pushed)  # the content stays, under the name pods use
    if not _in_containerd(layout, reference):
        raise cp.ClusterError(f"containerd did not list {reference} after the pull")
    stamp = _stamp(layout, reference)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(image_id)


def load_all(layout: cp.Layout, log: Callable[[str], None] = print) -> None:
    load(layout, [ref(name) for name in IMAGES], log)


def load(layout: cp.Layout, references: list[str], log: Callable[[str], None] = print) -> None:
    """Each image into the node unless containerd holds the same build already."""
    builds = {reference: podman_id(reference) for reference in references}
    with _only_loader(layout):
        missing = [
            reference for reference, image_id in builds.items() if not _loaded(layout, reference, image_id)
        ]
        if missing:
            with registry.running(layout) as address:
                for reference in missing:
                    _push_and_pull(layout, reference, builds[reference], address)
    for reference in builds:
        log(f"    {reference}: {'loaded into the node' if reference in missing else 'already on the node'}")


def preload(layout: cp.Layout, log: Callable[[str], None]) -> None:
    """Load every image in a background thread when the node runs and all are built.

    Best effort: a failure is logged, and the loader that needs the images (the demo's) meets it again
    and reports it."""
    if not node.running(layout):
        return
    try:
        for name in IMAGES:
            podman_id(ref(name))
    except cp.ClusterError:
        return  # `make test-k8s` builds no image; the node tier says so itself

    def load_quietly() -> None:
        try:
            load_all(layout, log=lambda line: None)
        except (cp.ClusterError, OSError, subprocess.SubprocessError) as error:
            log(f"preloading the images into the node failed (the demo loads them again): {error}")

    threading.Thread(target=load_quietly, name="node-images-preload", daemon=True).start()
