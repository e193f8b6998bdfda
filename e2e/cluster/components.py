"""Each component's command line, its health check, and a restart that waits for it to be healthy."""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Callable

from e2e.cluster.layout import ClusterError, Layout, log, port_in_use, wait_for
from e2e.cluster.nodeconfig import HOST_IP
from e2e.cluster.processes import pid_alive, read_pid, spawn, stop_component


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


def restart_component(layout: Layout, component: str) -> None:
    argv = json.loads(layout.cmdfile(component).read_text())
    stop_component(layout, component)
    port = layout.ports.get(component)
    if port is not None:
        wait_for(lambda: not port_in_use(port), 30, f"port {port} to be released")
    spawn(layout, component, argv)
    wait_healthy(layout, component, time.monotonic())
