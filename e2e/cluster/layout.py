"""Where the local control plane's binaries, state and ports are (all from the environment, nothing
started), and the small helpers every part uses: its error, its log line, a bounded wait, a port probe."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")

_PAUSE = threading.Event()  # never set: wait(t) is an interruptible pause


class ClusterError(RuntimeError):
    """The control plane cannot be brought up or down; the message says why and what to do."""


def read_versions() -> dict[str, str]:
    versions = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


@dataclass(frozen=True)
class Layout:
    """Where binaries, state and ports are; all derived from the environment, nothing started."""

    cache: Path
    state: Path
    port_base: int
    versions: dict[str, str]

    @classmethod
    def from_env(cls) -> Layout:
        home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        cache = Path(os.environ.get("DLLM_CP_CACHE", home_cache / "dllm-controlplane"))
        state = Path(os.environ.get("DLLM_CP_STATE", f"/tmp/dllm-cluster-{os.getuid()}"))
        return cls(cache, state, int(os.environ.get("DLLM_CP_PORT_BASE", "26400")), read_versions())

    # binaries
    @property
    def k8s_bin(self) -> Path:
        return self.cache / "bin" / f"k8s-v{self.versions['K8S_VERSION']}"

    @property
    def etcd_bin(self) -> Path:
        return self.cache / "bin" / f"etcd-v{self.versions['ETCD_VERSION']}" / "etcd"

    @property
    def kwok_bin(self) -> Path:
        return self.cache / "bin" / f"kwok-v{self.versions['KWOK_VERSION']}" / "kwok"

    @property
    def tools_bin(self) -> Path:
        v = self.versions
        return self.cache / "bin" / f"tools-kubectl-v{v['KUBECTL_VERSION']}-helm-v{v['HELM_VERSION']}"

    @property
    def kubectl(self) -> Path:
        return self.tools_bin / "kubectl"

    @property
    def kwok_stages(self) -> Path:
        return (
            self.cache
            / "gomod"
            / "sigs.k8s.io"
            / f"kwok@v{self.versions['KWOK_VERSION']}"
            / "kustomize"
            / "stage"
        )

    # state
    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.state / "logs" / "audit.log"

    def log(self, component: str) -> Path:
        return self.state / "logs" / f"{component}.log"

    def pidfile(self, component: str) -> Path:
        return self.state / "run" / f"{component}.pid"

    def cmdfile(self, component: str) -> Path:
        return self.state / "run" / f"{component}.json"

    # ports, all on 127.0.0.1
    @property
    def ports(self) -> dict[str, int]:
        b = self.port_base
        return {
            "etcd": b,
            "etcd-peer": b + 1,
            "etcd-metrics": b + 2,
            "kube-apiserver": b + 3,
            "kube-controller-manager": b + 4,
            "kube-scheduler": b + 5,
            "kwok": b + 6,
            # Stable, as podman's blob cache is keyed by the registry's address: a new one pushes
            # every layer again.
            "image-registry": b + 7,
        }

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    def missing_binaries(self) -> list[Path]:
        wanted = [self.k8s_bin / c for c in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")]
        wanted += [self.etcd_bin, self.kwok_bin, self.kubectl, self.tools_bin / "helm"]
        return [path for path in wanted if not path.exists()]


def log(message: str, start: float | None = None) -> None:
    prefix = f"[cluster {time.monotonic() - start:5.1f}s] " if start is not None else "[cluster] "
    print(prefix + message, file=sys.stderr, flush=True)


def wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        _PAUSE.wait(interval)  # poll interval of a bounded wait
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0
