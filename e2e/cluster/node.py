"""One real node beside the kwok ones: containerd, kubelet, kube-proxy and kube-router's NetworkPolicy
firewall in their own network namespace, CoreDNS as a pod on it, images loaded from local archives (no
registry anywhere).

The node is a singleton of the machine (one namespace, veth pair and pod network), owned by the cluster
that started it (/run/dllm-node.json names its state folder); a second cluster runs without it.
Its files live under <state>/node; `down` removes its processes, mounts, cgroups and links even after a
crash. Needs root; DLLM_CP_REAL_NODE=0 turns it off, =1 makes a missing prerequisite an error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from e2e.cluster import controlplane as cp
from e2e.cluster import nodeconfig as nc
from e2e.cluster import nodehost as host
from e2e.cluster import registry

OWNER = Path("/run/dllm-node.json")
COMPONENTS = ("node-apiforward", "containerd", "kubelet", "kube-proxy", "kube-router")
# The kubelet sets these machine-wide; `down` puts back what was there before.
KUBELET_SYSCTLS = ("vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
                   "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes")  # fmt: skip


class Binaries:
    def __init__(self, layout: cp.Layout) -> None:
        v, b = layout.versions, layout.cache / "bin"
        self.containerd = b / f"containerd-v{v['CONTAINERD_VERSION']}"
        self.cni = b / f"cni-plugins-v{v['CNI_PLUGINS_VERSION']}"
        self.kubelet, self.kube_proxy = layout.k8s_bin / "kubelet", layout.k8s_bin / "kube-proxy"
        self.kube_router = b / f"kube-router-v{v['KUBE_ROUTER_VERSION']}" / "kube-router"
        self.registry = registry.binary(layout)
        self.images = (
            layout.cache / "images" / f"node-v{v['NODE_IMAGES_VERSION']}-coredns-v{v['COREDNS_VERSION']}"
        )
        self.image_names = {
            "pause": f"localhost/dllm/pause:{v['NODE_IMAGES_VERSION']}",
            "probe": f"localhost/dllm/probe:{v['NODE_IMAGES_VERSION']}",
            "coredns": f"localhost/dllm/coredns:v{v['COREDNS_VERSION']}",
        }

    @property
    def ctr(self) -> Path:
        return self.containerd / "ctr"

    def missing(self) -> list[Path]:
        wanted = [self.containerd / "containerd", self.containerd / "containerd-shim-runc-v2", self.ctr,
                  self.cni / "bridge", self.cni / "host-local", self.cni / "loopback", self.cni / "portmap",
                  self.kubelet, self.kube_proxy, self.kube_router, self.registry, Path(nc.RUNC)]  # fmt: skip
        wanted += [self.images / f"{name}.tar" for name in self.image_names]
        return [p for p in wanted if not p.exists()] + [
            Path(t) for t in ("socat", "iptables", "ipset") if not shutil.which(t)
        ]


def paths_of(layout: cp.Layout) -> nc.NodePaths:
    store = layout.cache / "node-store" / f"containerd-v{layout.versions['CONTAINERD_VERSION']}"
    return nc.NodePaths(layout.state / "node", store)


def probe_image(layout: cp.Layout | None = None) -> str:
    return Binaries(layout or cp.Layout.from_env()).image_names["probe"]


# ---- ownership -------------------------------------------------------------------------------------


def _owner() -> dict[str, object]:
    try:
        data = json.loads(OWNER.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _owner_alive(state: str) -> bool:
    for component in COMPONENTS:
        try:
            if cp.pid_alive(int(Path(state, "run", f"{component}.pid").read_text())):
                return True
        except (OSError, ValueError):
            continue
    return False


def owned_by_other(layout: cp.Layout) -> str | None:
    """The state folder of another live cluster owning the node, if there is one."""
    state = str(_owner().get("state", ""))
    return state if state and state != str(layout.state) and _owner_alive(state) else None


def why_not(layout: cp.Layout) -> str | None:
    """Why this cluster cannot have the real node, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespace, mounts, cgroups)"
    missing = Binaries(layout).missing()
    if missing:
        return f"missing {missing[0]} (run `make cluster-build` or bash e2e/cluster/build.sh)"
    other = owned_by_other(layout)
    return f"the cluster in {other} owns it" if other else None


# ---- up --------------------------------------------------------------------------------------------


def running(layout: cp.Layout) -> bool:
    return all((pid := cp.read_pid(layout, c)) is not None and cp.pid_alive(pid) for c in COMPONENTS)


def node_ready(layout: cp.Layout) -> bool:
    try:
        node = json.loads(cp.kubectl(layout, "get", "node", nc.NODE_NAME, "-o", "json"))
    except cp.ClusterError:
        return False
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def ensure(layout: cp.Layout, start: float) -> None:
    """Start the node unless switched off or impossible (then say why), or reuse it when it runs."""
    wanted = os.environ.get("DLLM_CP_REAL_NODE", "auto")
    if wanted == "0":
        return
    reason = why_not(layout)
    if reason:
        if wanted == "1":
            raise cp.ClusterError(f"real node: {reason}")
        cp.log(f"no real node: {reason}", start)
        return
    if running(layout) and node_ready(layout):
        cp.log(f"real node {nc.NODE_NAME} already running: reusing it", start)
        return
    up(layout, start)


def _issue(layout: cp.Layout, paths: nc.NodePaths, name: str, subject: str) -> None:
    ca = layout.state / "pki"
    key, csr, crt = (str(paths.pki / f"{name}.{ext}") for ext in ("key", "csr", "crt"))
    cp.openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", subject, cwd=paths.pki
    )
    signing = ["-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"), "-CAcreateserial", "-days", "3650"]
    cp.openssl(
        "x509", "-req", "-in", csr, *signing, "-extfile", str(ca / "client.ext"), "-out", crt, cwd=paths.pki
    )
    server = f"https://{nc.HOST_IP}:{layout.ports['kube-apiserver']}"
    config = nc.kubeconfig(server, paths.pki / "ca.crt", Path(crt), Path(key))
    paths.kubeconfig(name).write_text(json.dumps(config, indent=2))


def write_files(layout: cp.Layout, paths: nc.NodePaths, binaries: Binaries) -> None:
    for folder in (
        paths.pki,
        paths.cni_conf,
        paths.cni_ipam,
        paths.kubelet,
        paths.pod_logs,
        paths.containerd,
    ):
        folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(layout.state / "pki" / "ca.crt", paths.pki / "ca.crt")
    _issue(layout, paths, "kubelet", f"/O=system:nodes/CN=system:node:{nc.NODE_NAME}")
    _issue(layout, paths, "kube-proxy", "/CN=system:kube-proxy")
    _issue(layout, paths, "kube-router", f"/CN={nc.KUBE_ROUTER_USER}")
    paths.containerd_config.write_text(nc.containerd_toml(paths, binaries.image_names["pause"], binaries.cni))
    (paths.cni_conf / f"10-{nc.CNI_NETWORK}.conflist").write_text(json.dumps(nc.cni_conflist(paths)))
    paths.config("kubelet").write_text(json.dumps(nc.kubelet_config(paths)))
    paths.config("kube-proxy").write_text(json.dumps(nc.kube_proxy_config(paths)))


def _in_node(binaries: Binaries, *argv: str) -> list[str]:
    path = f"{binaries.containerd}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return ["nsenter", f"--net={host.NETNS_PATH}", "env", f"PATH={path}", *argv]


def _alive_or_raise(layout: cp.Layout, component: str) -> None:
    pid = cp.read_pid(layout, component)
    if pid is None or not cp.pid_alive(pid):
        tail = layout.log(component).read_text(errors="replace")[-2000:]
        raise cp.ClusterError(f"{component} exited during start; last log lines:\n{tail}")


def ctr(layout: cp.Layout, *args: str, stdin: IO[bytes] | None = None) -> str:
    binaries, paths = Binaries(layout), paths_of(layout)
    argv = [str(binaries.ctr), f"--address={paths.socket}", "--namespace=k8s.io", *args]
    result = subprocess.run(argv, stdin=stdin, capture_output=True, check=False, timeout=1800)
    if result.returncode != 0:
        raise cp.ClusterError(
            f"ctr {' '.join(args)} failed: {result.stderr.decode(errors='replace').strip()}"
        )
    return result.stdout.decode(errors="replace")


def load_image(source: Path | IO[bytes] | None, layout: cp.Layout | None = None) -> str:
    """Import an OCI or docker archive into the node's k8s.io namespace, streaming it: a path, a binary
    file object (e.g. `podman save`'s stdout pipe) or None for this process's stdin. Returns ctr's report.

    Pods then use the image by its full name with imagePullPolicy: Never (or IfNotPresent). Images live in
    the node's containerd under the state folder: load them again after `down`/`up`."""
    layout = layout or cp.Layout.from_env()
    pid = cp.read_pid(layout, "containerd")
    if pid is None or not cp.pid_alive(pid):
        raise cp.ClusterError("the real node's containerd is not running (python3 -m e2e.cluster up)")
    args = ["images", "import", "--snapshotter=overlayfs", "--platform=linux/amd64", "-"]
    if isinstance(source, Path):
        with source.open("rb") as stream:
            return ctr(layout, *args, stdin=stream)
    return ctr(layout, *args, stdin=source)


def forget_old_pods(layout: cp.Layout) -> None:
    """The store outlives `down`, and with it the records of the last run's sandboxes and containers
    (their processes and mounts are gone): remove them, with their snapshots, before the kubelet starts,
    so it starts from an empty node as the fresh API server expects. Images stay."""
    for kind in ("containers", "sandboxes"):
        # `ctr sandboxes ls` has no -q: the id is the first column, under a header line.
        ids = [line.split()[0] for line in ctr(layout, kind, "ls").splitlines()[1:] if line.strip()]
        if ids:
            ctr(layout, kind, "rm", *ids)


def _save_sysctls() -> dict[str, str]:
    return {k: Path("/proc/sys", k.replace(".", "/")).read_text().strip() for k in KUBELET_SYSCTLS}


def up(layout: cp.Layout, start: float) -> None:
    binaries, paths = Binaries(layout), paths_of(layout)
    down(layout, quiet=True)
    netns_mounted = any(p == "/run/netns" for p, _ in host.mountinfo())
    OWNER.write_text(json.dumps({"state": str(layout.state), "sysctls": _save_sysctls(),
                                 "netns_was_mounted": netns_mounted,
                                 "shim_sockets": host.shim_sockets()}))  # fmt: skip
    host.create_network()
    host.create_cgroups()
    write_files(layout, paths, binaries)
    port = layout.ports["kube-apiserver"]
    # The API server listens on 127.0.0.1 only: forward the host end of the veth to it.
    listen = f"TCP-LISTEN:{port},bind={nc.HOST_IP},reuseaddr,fork"
    cp.spawn(layout, "node-apiforward", ["socat", listen, f"TCP:127.0.0.1:{port}"])
    cp.spawn(layout, "containerd", _in_node(binaries, str(binaries.containerd / "containerd"),
                                            f"--config={paths.containerd_config}"))  # fmt: skip

    def containerd_up() -> bool:
        _alive_or_raise(layout, "containerd")
        return (
            paths.socket.exists()
            and subprocess.run(
                [str(binaries.ctr), f"--address={paths.socket}", "version"], capture_output=True, check=False
            ).returncode
            == 0
        )

    cp.wait_for(containerd_up, 60, f"containerd (log: {layout.log('containerd')})")
    forget_old_pods(layout)
    for name in binaries.image_names:
        load_image(binaries.images / f"{name}.tar", layout)
    cp.log(f"containerd v{layout.versions['CONTAINERD_VERSION']} up, images loaded", start)
    cp.spawn(layout, "kubelet", _in_node(
        binaries, str(binaries.kubelet), f"--config={paths.config('kubelet')}",
        f"--kubeconfig={paths.kubeconfig('kubelet')}", f"--root-dir={paths.kubelet}",
        f"--hostname-override={nc.NODE_NAME}", f"--node-ip={nc.NODE_IP}",
        f"--node-labels={'='.join(nc.LABEL)}", "--v=1"))  # fmt: skip
    cp.spawn(layout, "kube-proxy", _in_node(binaries, str(binaries.kube_proxy),
                                            f"--config={paths.config('kube-proxy')}", "--v=1"))  # fmt: skip

    def ready() -> bool:
        for component in COMPONENTS[:-1]:
            _alive_or_raise(layout, component)
        return node_ready(layout)

    cp.wait_for(ready, 120, f"node {nc.NODE_NAME} Ready (log: {layout.log('kubelet')})", interval=0.5)
    cp.log(f"real node {nc.NODE_NAME} Ready ({nc.NODE_IP}, pods {nc.POD_CIDR})", start)
    start_firewall(layout, binaries, paths)
    cp.log(f"kube-router v{layout.versions['KUBE_ROUTER_VERSION']} enforcing NetworkPolicy", start)
    cp.kubectl(layout, "apply", "--server-side", "--force-conflicts", "-f", "-",
               input_text=nc.coredns_manifests(binaries.image_names["coredns"]))  # fmt: skip
    cp.kubectl(layout, "-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=120s")
    cp.log(f"CoreDNS ready at {nc.DNS_IP}", start)


def start_firewall(layout: cp.Layout, binaries: Binaries, paths: nc.NodePaths) -> None:
    """kube-router's firewall beside kube-proxy; it reads its Node for the node IP, so it starts once the
    kubelet registered it. Returns when its first sync put every existing policy's rules in place."""
    rbac = nc.kube_router_rbac()
    cp.kubectl(layout, "apply", "--server-side", "--force-conflicts", "-f", "-", input_text=rbac)
    log, env = layout.log("kube-router"), f"NODE_NAME={nc.NODE_NAME}"
    offset = log.stat().st_size if log.exists() else 0  # the log file is appended to across runs
    cp.spawn(layout, "kube-router",
             _in_node(binaries, env, str(binaries.kube_router), *nc.kube_router_args(paths)))  # fmt: skip

    def synced() -> bool:
        _alive_or_raise(layout, "kube-router")
        with log.open("rb") as lines:
            lines.seek(offset)
            return nc.KUBE_ROUTER_SYNCED.encode() in lines.read()

    cp.wait_for(synced, 60, f"kube-router's first policy sync (log: {log})", interval=0.2)


# ---- down ------------------------------------------------------------------------------------------


@contextmanager
def _step(what: str, errors: list[str]) -> Iterator[None]:
    try:
        yield
    except (cp.ClusterError, OSError, subprocess.SubprocessError) as error:
        errors.append(f"{what}: {error}")


def down(layout: cp.Layout, quiet: bool = False) -> None:
    """Remove everything of the node this cluster owns (or a crashed owner left); idempotent."""
    if os.geteuid() != 0 or owned_by_other(layout):
        return
    start, owner, errors = time.monotonic(), _owner(), list[str]()
    states = {layout.state, Path(str(owner["state"]))} if owner.get("state") else {layout.state}
    with _step("stop kubelet, kube-proxy, kube-router", errors):
        for component in ("kubelet", "kube-proxy", "kube-router"):
            cp.stop_component(layout, component)
    with _step("kill containers", errors):
        host.kill_all(host.cgroup_pids())
    with _step("stop containerd and its shims", errors):
        cp.stop_component(layout, "containerd")
        shims = [Binaries(layout).containerd / "containerd-shim-runc-v2"]
        host.kill_all(host.pids_in_netns() + host.pids_running(shims))
    with _step("shim sockets", errors):
        sockets = owner.get("shim_sockets")
        host.remove_shim_sockets({str(s) for s in sockets} if isinstance(sockets, list) else set())
    with _step("unmount", errors):
        for state in states:
            for _ in range(10):  # stacked mounts come off one layer per pass
                if not host.unmount_below(state / "node"):
                    break
    with _step("network", errors):
        host.delete_network()
        if not owner.get("netns_was_mounted", True) and not any(Path("/run/netns").iterdir()):
            host.unmount_below(Path("/run/netns"))
    with _step("cgroups", errors):
        host.remove_cgroups()
    with _step("API forwarder and image registry", errors):
        cp.stop_component(layout, "node-apiforward")
        cp.stop_component(layout, registry.COMPONENT)
    with _step("sysctls", errors):
        sysctls = owner.get("sysctls")
        for key, value in (sysctls if isinstance(sysctls, dict) else {}).items():
            Path("/proc/sys", str(key).replace(".", "/")).write_text(str(value))
    with _step("logs", errors):
        _remove_log_links(states)
    for state in states:
        shutil.rmtree(state / "node", ignore_errors=True)
    if errors:
        raise cp.ClusterError("real node teardown incomplete: " + "; ".join(errors))
    OWNER.unlink(missing_ok=True)
    if not quiet:
        cp.log("real node removed: no process, mount, namespace, link or route left", start)


def _remove_log_links(states: set[Path]) -> None:
    """The kubelet links container logs into /var/log/containers (a fixed path): drop ours."""
    folder = Path("/var/log/containers")
    if not folder.is_dir():
        return
    ours = tuple(str(s / "node") + "/" for s in states)
    for link in folder.iterdir():
        if link.is_symlink() and os.readlink(link).startswith(ours):
            link.unlink()


def kill_for_test(layout: cp.Layout) -> None:
    """SIGKILL the node's daemons, as a crash would (containers and mounts stay)."""
    for component in COMPONENTS:
        pid = cp.read_pid(layout, component)
        if pid is not None and cp.pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
