"""A real local Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, and kwok faking the kubelets of GPU/RDMA nodes.

Standard library only (plus openssl and the pinned kubectl), so `cluster-env` and `cluster-down` run with
any python3 and never build. Binaries come from e2e/cluster/build.sh, cached outside the clone.
Each component is a detached process with a pid file and its own log under the state folder, so one
component can be restarted alone (the operator tests restart the API server).

The parts: `layout` (paths, ports, the error and helpers), `processes`, `pki`, `components` (command
lines, health), `kwok_nodes`. This module brings the cluster up and down, and names what callers use.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import shutil
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager

from e2e.cluster.components import ARGV, healthy, restart_component, wait_healthy
from e2e.cluster.kwok_nodes import (
    GPU_RESOURCE,
    RDMA_RESOURCE,
    create_nodes,
    fake_node,
    kubectl,
    node_names,
    render_stages,
    wait_default_service_account,
)
from e2e.cluster.layout import COMPONENTS, ClusterError, Layout, log, port_in_use, read_versions, wait_for
from e2e.cluster.pki import AUDIT_POLICY, make_pki, openssl, write_kubeconfig
from e2e.cluster.processes import (
    kill_component,
    pid_alive,
    read_pid,
    running_components,
    spawn,
    stop_component,
)

__all__ = [
    "COMPONENTS",
    "GPU_RESOURCE",
    "RDMA_RESOURCE",
    "ClusterError",
    "Layout",
    "down",
    "env_exports",
    "fake_node",
    "kill_component",
    "kubectl",
    "log",
    "node_names",
    "openssl",
    "pid_alive",
    "port_in_use",
    "read_pid",
    "read_versions",
    "restart_component",
    "running_components",
    "spawn",
    "stop_component",
    "up",
    "wait_for",
]


@contextmanager
def _exclusive(layout: Layout) -> Iterator[None]:
    """One up or down at a time per state folder: test sessions started together each call up(), and a
    second one seeing the first's half-started cluster would tear it down. The lock file sits beside
    the state folder, which down removes."""
    layout.state.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{layout.state}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def up(nodes: int = 2) -> Layout:
    """Start the cluster, or reuse it when it runs; waits for another process's up or down first."""
    layout = Layout.from_env()
    with _exclusive(layout):
        return _up(layout, nodes)


def _up(layout: Layout, nodes: int) -> Layout:
    start = time.monotonic()
    missing = layout.missing_binaries()
    if missing:
        raise ClusterError(f"binaries missing ({missing[0]}, ...): run `make cluster-build` first")
    alive = running_components(layout)
    if alive == list(COMPONENTS) and all(healthy(layout, c) for c in COMPONENTS):
        log(f"already running at {layout.server}: reusing it (make cluster-down to stop)")
        real_node().ensure(layout, start)
        return layout
    if alive:
        log(f"stale cluster ({', '.join(alive)} still alive): stopping it first")
    _down(layout, quiet=True)
    busy = [f"{name} {port}" for name, port in layout.ports.items() if port_in_use(port)]
    if busy:
        raise ClusterError(
            f"ports in use by another program: {', '.join(busy)}; stop it or set "
            "DLLM_CP_PORT_BASE to a free range"
        )
    for sub in ("run", "logs", "etcd"):
        (layout.state / sub).mkdir(parents=True, exist_ok=True)
    make_pki(layout.state / "pki")
    write_kubeconfig(layout)
    (layout.state / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
    log(f"state in {layout.state}; starting Kubernetes v{layout.versions['K8S_VERSION']}", start)
    for component in ("etcd", "kube-apiserver"):
        spawn(layout, component, ARGV[component](layout))
        wait_healthy(layout, component, start)
    render_stages(layout)
    for component in ("kube-controller-manager", "kube-scheduler", "kwok"):
        spawn(layout, component, ARGV[component](layout))
    for component in ("kube-controller-manager", "kube-scheduler", "kwok"):
        wait_healthy(layout, component, start)
    create_nodes(layout, nodes, start)
    wait_default_service_account(layout, start)
    real_node().ensure(layout, start)
    log(f"ready in {time.monotonic() - start:.1f}s: {layout.server}", start)
    return layout


def down(quiet: bool = False) -> None:
    layout = Layout.from_env()
    with _exclusive(layout):
        _down(layout, quiet)


def _down(layout: Layout, quiet: bool) -> None:
    start = time.monotonic()
    real_node().down(layout, quiet)  # first: its mounts live under the state folder removed below
    for component in reversed(COMPONENTS):
        stop_component(layout, component)
    for name, port in layout.ports.items():
        wait_for(lambda port=port: not port_in_use(port), 30, f"port {port} ({name}) to be released")  # type: ignore[misc]
    if layout.state.exists():
        shutil.rmtree(layout.state)
    if not quiet:
        log("stopped; no process or port left", start)


def real_node() -> types.ModuleType:
    """e2e.cluster.node, imported late: it imports this module."""
    return importlib.import_module("e2e.cluster.node")


def env_exports() -> str:
    layout = Layout.from_env()
    return f'export KUBECONFIG="{layout.kubeconfig}"\nexport PATH="{layout.tools_bin}:$PATH"\n'
