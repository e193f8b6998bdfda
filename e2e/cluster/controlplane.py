"""A real local Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, and kwok faking the kubelets of GPU/RDMA nodes.

Standard library only (plus openssl and the pinned kubectl), so `cluster-env` and `cluster-down` run with
any python3 and never build. Binaries come from e2e/cluster/build.sh, cached outside the clone.
Each component is a detached process with a pid file and its own log under the state folder, so one
component can be restarted alone (the operator tests restart the API server).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster.nodeconfig import HOST_IP

HERE = Path(__file__).resolve().parent
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/hca_shared_devices_a"

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


# ---- processes ------------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # the process may end between the signal and this read
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[-1]
    except OSError:
        return False
    return not state.startswith("Z")


def read_pid(layout: Layout, component: str) -> int | None:
    try:
        return int(layout.pidfile(component).read_text())
    except (FileNotFoundError, ValueError):
        return None


def running_components(layout: Layout) -> list[str]:
    return [c for c in COMPONENTS if (pid := read_pid(layout, c)) is not None and pid_alive(pid)]


def spawn(layout: Layout, component: str, argv: list[str]) -> None:
    """Start a component detached (own session, so it survives the caller), logging to its file."""
    layout.cmdfile(component).write_text(json.dumps(argv))
    with layout.log(component).open("ab") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=layout.state,
        )
    layout.pidfile(component).write_text(str(process.pid))


def stop_component(layout: Layout, component: str, timeout: float = 20) -> None:
    pid = read_pid(layout, component)
    if pid is None or not pid_alive(pid):
        layout.pidfile(component).unlink(missing_ok=True)
        return
    os.killpg(pid, signal.SIGTERM)
    try:
        wait_for(lambda: not pid_alive(pid), timeout, f"{component} to stop")
    except ClusterError:
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, f"{component} to die")
    layout.pidfile(component).unlink(missing_ok=True)


def kill_component(layout: Layout, component: str) -> None:
    """SIGKILL, as a crash would."""
    pid = read_pid(layout, component)
    if pid is not None and pid_alive(pid):
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, f"{component} to die")


def restart_component(layout: Layout, component: str) -> None:
    argv = json.loads(layout.cmdfile(component).read_text())
    stop_component(layout, component)
    port = layout.ports.get(component)
    if port is not None:
        wait_for(lambda: not port_in_use(port), 30, f"port {port} to be released")
    spawn(layout, component, argv)
    wait_healthy(layout, component, time.monotonic())


# ---- PKI and kubeconfig ---------------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=dllm-local-ca",
        cwd=pki,
    )
    sans = (
        f"subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:{HOST_IP},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n"
    )
    (pki / "server.ext").write_text(sans)
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subject, ext in (
        ("apiserver", "/CN=kube-apiserver", "server.ext"),
        ("admin", "/O=system:masters/CN=dllm-admin", "client.ext"),
        ("kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "client.ext"),
    ):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            subject,
            cwd=pki,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-extfile",
            ext,
            "-out",
            f"{name}.crt",
            cwd=pki,
        )
    openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(layout: Layout) -> None:
    pki = layout.state / "pki"
    # JSON is YAML: no YAML library needed.
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "dllm-local",
        "clusters": [{"name": "dllm-local", "cluster": {
            "server": layout.server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": "dllm-admin", "user": {
            "client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")}}],
        "contexts": [{"name": "dllm-local", "context": {"cluster": "dllm-local", "user": "dllm-admin"}}],
    }  # fmt: skip
    layout.kubeconfig.write_text(json.dumps(config, indent=2))


AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}


# ---- component command lines ----------------------------------------------------------------------


def etcd_argv(layout: Layout) -> list[str]:
    p = layout.ports
    return [
        str(layout.etcd_bin),
        "--name=dllm",
        f"--data-dir={layout.state / 'etcd'}",
        "--unsafe-no-fsync",
        f"--listen-client-urls=http://127.0.0.1:{p['etcd']}",
        f"--advertise-client-urls=http://127.0.0.1:{p['etcd']}",
        f"--listen-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
        f"--initial-cluster=dllm=http://127.0.0.1:{p['etcd-peer']}",
        f"--listen-metrics-urls=http://127.0.0.1:{p['etcd-metrics']}",
        "--quota-backend-bytes=4294967296",
        "--log-level=warn",
    ]


def apiserver_argv(layout: Layout) -> list[str]:
    pki, p = layout.state / "pki", layout.ports
    return [
        str(layout.k8s_bin / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
        "--bind-address=127.0.0.1",
        # Pods on the real node reach the API server through a forwarder on the host end of its veth.
        f"--advertise-address={HOST_IP}",
        f"--secure-port={p['kube-apiserver']}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP",  # never resolve node names on the host
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--api-audiences=https://kubernetes.default.svc.cluster.local",
        "--service-cluster-ip-range=10.96.0.0/16",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--audit-policy-file={layout.state / 'audit-policy.json'}",
        f"--audit-log-path={layout.audit_log}",
        "--audit-log-maxsize=200",
        "--audit-log-format=json",
        "--profiling=false",
        "--v=1",
    ]


def _client_component_flags(layout: Layout, component: str) -> list[str]:
    """Flags shared by the controller-manager and the scheduler: identity, serving, no election."""
    kubeconfig = str(layout.kubeconfig)
    return [
        str(layout.k8s_bin / component),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={layout.ports[component]}",
        "--leader-elect=false",
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        "--v=1",
    ]


def controller_manager_argv(layout: Layout) -> list[str]:
    pki = layout.state / "pki"
    return [
        *_client_component_flags(layout, "kube-controller-manager"),
        "--use-service-account-credentials=true",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
        "--concurrent-statefulset-syncs=10",
        "--concurrent-deployment-syncs=10",
    ]


def scheduler_argv(layout: Layout) -> list[str]:
    return _client_component_flags(layout, "kube-scheduler")


def kwok_argv(layout: Layout) -> list[str]:
    return [
        str(layout.kwok_bin),
        f"--kubeconfig={layout.kubeconfig}",
        f"--config={layout.state / 'stages.yaml'}",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        "--node-lease-duration-seconds=40",
        "--cidr=10.244.0.0/16",
        "--node-ip=10.244.255.1",
        f"--server-address=127.0.0.1:{layout.ports['kwok']}",
    ]


ARGV: dict[str, Callable[[Layout], list[str]]] = {
    "etcd": etcd_argv,
    "kube-apiserver": apiserver_argv,
    "kube-controller-manager": controller_manager_argv,
    "kube-scheduler": scheduler_argv,
    "kwok": kwok_argv,
}


# ---- health ---------------------------------------------------------------------------------------


def _https_ok(url: str, layout: Layout) -> bool:
    pki = layout.state / "pki"
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    if not url.startswith(layout.server):  # controller-manager and scheduler serve self-signed certs
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as response:  # noqa: S310
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


def healthy(layout: Layout, component: str) -> bool:
    p = layout.ports
    if component == "etcd":
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{p['etcd-metrics']}/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False
    if component == "kube-apiserver":
        return _https_ok(f"{layout.server}/readyz", layout)
    if component in ("kube-controller-manager", "kube-scheduler"):
        return _https_ok(f"https://127.0.0.1:{p[component]}/healthz", layout)
    return port_in_use(p["kwok"])


def wait_healthy(layout: Layout, component: str, start: float) -> None:
    pid = read_pid(layout, component)

    def ok() -> bool:
        if pid is None or not pid_alive(pid):
            tail = layout.log(component).read_text(errors="replace")[-2000:]
            raise ClusterError(f"{component} exited during start; last log lines:\n{tail}")
        return healthy(layout, component)

    wait_for(ok, 120, f"{component} to be healthy (log: {layout.log(component)})")
    log(f"{component} healthy", start)


# ---- kubectl helpers ------------------------------------------------------------------------------


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


# ---- up / down ------------------------------------------------------------------------------------


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
