"""The images `make images` built, loaded into the real node's containerd (nothing can be pulled here).

An image is streamed from podman (`podman save --format docker-archive`, which carries its name) into
`ctr images import` once per build: containerd's store outlives `down`, and a stamp in it records the
podman image id loaded, so a warm run (a later `up` included) loads nothing.

A fresh build takes minutes to load (the vllm-cpu image is several GB): the test session starts it in
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
from e2e.cluster import node

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


def load(layout: cp.Layout, reference: str) -> bool:
    """Load `reference` unless containerd holds the same build already; True when it loaded."""
    image_id = podman_id(reference)
    with _only_loader(layout):
        return _load_locked(layout, reference, image_id)


def _load_locked(layout: cp.Layout, reference: str, image_id: str) -> bool:
    stamp = _stamp(layout, reference)
    if stamp.exists() and stamp.read_text() == image_id and _in_containerd(layout, reference):
        return False
    save = subprocess.Popen(
        ["podman", "save", "--format", "docker-archive", reference],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=PODMAN_ENV,
    )  # fmt: skip
    assert save.stdout is not None
    try:
        node.ctr(layout, "images", "import", "--snapshotter=overlayfs", "--platform=linux/amd64",
                 "-", stdin=save.stdout)  # fmt: skip
    finally:
        save.stdout.close()
        _, errors = save.communicate(timeout=1800)
    if save.returncode != 0:
        raise cp.ClusterError(f"podman save {reference} failed: {errors.decode(errors='replace').strip()}")
    if not _in_containerd(layout, reference):
        raise cp.ClusterError(f"containerd did not list {reference} after the import")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(image_id)
    return True


def load_all(layout: cp.Layout, log: Callable[[str], None] = print) -> None:
    for name in IMAGES:
        reference = ref(name)
        loaded = load(layout, reference)
        log(f"    {reference}: {'loaded into the node' if loaded else 'already on the node'}")


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
