"""Configuration files and manifests of the real node (e2e/cluster/node.py): containerd, the CNI network,
the kubelet, kube-proxy, the NetworkPolicy enforcer (kube-router's firewall) and CoreDNS. Pure functions
of paths and constants; nothing here starts anything."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "dllm-real-0"
LABEL = ("dllm.dev/node", "real")
TAINT = {"key": "dllm.dev/real-node", "value": "true", "effect": "NoSchedule"}
NETNS = "dllm-node"
HOST_VETH, NODE_VETH = "dllm-veth0", "dllm-veth1"
HOST_IP, NODE_IP = "10.250.0.1", "10.250.0.2"  # a /30 between the host and the node's namespace
BRIDGE = "dllm-br0"
POD_CIDR, POD_GATEWAY = "10.242.0.0/16", "10.242.0.1"  # podman uses 10.88/16, kwok 10.244/16
SERVICE_CIDR = "10.96.0.0/16"  # the API server's --service-cluster-ip-range
DNS_IP = "10.96.0.10"
CNI_NETWORK = "dllm-pods"
CGROUP = "dllm-node"  # the kubelet's cgroupRoot, below the root of every cgroup hierarchy
RUNC = "/usr/sbin/runc"  # Debian's runc (crun refuses this machine's hybrid cgroups)
NOFILE = 20000  # the machine's hard limit: asking more fails with EPERM


@dataclass(frozen=True)
class NodePaths:
    """Every file and folder of the node: all under the cluster's state folder, but for containerd's
    store (content and unpacked images), which outlives `down` so that a multi-GB image is imported
    once per machine, not once per cluster."""

    root: Path
    store: Path

    @property
    def containerd(self) -> Path:
        return self.root / "containerd"

    @property
    def containerd_config(self) -> Path:
        return self.containerd / "config.toml"

    @property
    def socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    def config(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def kubeconfig(self, user: str) -> Path:
        return self.root / f"{user}.kubeconfig"


def containerd_toml(paths: NodePaths, pause_image: str, cni_bin: Path) -> str:
    cri, runtime = "plugins.'io.containerd.cri.v1.images'", "plugins.'io.containerd.cri.v1.runtime'"
    state = paths.containerd / "state"
    return f"""version = 3
root = '{paths.store}'
state = '{state}'
disabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.tracing.processor.v1.otlp',
  'io.containerd.internal.v1.tracing', 'io.containerd.snapshotter.v1.btrfs',
  'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.blockfile', 'io.containerd.snapshotter.v1.erofs']

[grpc]
  address = '{paths.socket}'

[ttrpc]
  address = '{paths.containerd / "containerd.ttrpc.sock"}'

[metrics]
  address = ''

[plugins.'io.containerd.internal.v1.opt']
  path = '{paths.containerd / "opt"}'

[{cri}]
  snapshotter = 'overlayfs'
  [{cri}.pinned_images]
    sandbox = '{pause_image}'

[{runtime}]
  netns_mounts_under_state_dir = true
  # No CAP_SYS_RESOURCE here: runc cannot set a negative oom_score_adj (sandboxes ask -998).
  restrict_oom_score_adj = true
  enable_cdi = false
  [{runtime}.containerd]
    default_runtime_name = 'runc'
    [{runtime}.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [{runtime}.containerd.runtimes.runc.options]
        BinaryName = '{RUNC}'
        Root = '{state / "runc"}'
        SystemdCgroup = false
  [{runtime}.cni]
    bin_dirs = ['{cni_bin}']
    conf_dir = '{paths.cni_conf}'

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
"""


def cni_conflist(paths: NodePaths) -> dict[str, object]:
    bridge = {
        "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
        "ipam": {"type": "host-local", "dataDir": str(paths.cni_ipam),
                 "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                 "routes": [{"dst": "0.0.0.0/0"}]},
    }  # fmt: skip
    portmap = {"type": "portmap", "capabilities": {"portMappings": True}}
    return {"cniVersion": "1.0.0", "name": CNI_NETWORK, "plugins": [bridge, portmap]}


def kubelet_config(paths: NodePaths) -> dict[str, object]:
    relaxed = {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
               "imagefs.available": "1%", "imagefs.inodesFree": "1%"}  # fmt: skip
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine has cgroup v1 (KEP-5573)
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP}",
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        "podLogsDir": str(paths.pod_logs),
        "volumePluginDir": str(paths.kubelet / "volume-plugins"),
        "address": NODE_IP,
        "healthzBindAddress": "127.0.0.1",
        "readOnlyPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(paths.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": "cluster.local",
        "clusterDNS": [DNS_IP],
        "resolvConf": "",  # pods see only the cluster's DNS, never the machine's resolver
        "registerWithTaints": [TAINT],
        "maxOpenFiles": NOFILE,
        "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE, which this machine's root lacks
        "maxPods": 60,
        "failSwapOn": False,
        "evictionHard": relaxed,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
    }


def kube_proxy_config(paths: NodePaths) -> dict[str, object]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(paths.kubeconfig("kube-proxy"))},
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256",  # inside the node's namespace
        "metricsBindAddress": "127.0.0.1:10249",
        # Conntrack limits and timeouts are machine-wide: leave them as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s"},
        "oomScoreAdj": 0,
    }


def kubeconfig(server: str, ca: Path, cert: Path, key: Path) -> dict[str, object]:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "node",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "node", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "node", "context": {"cluster": "local", "user": "node"}}],
    }  # fmt: skip


# kube-router's firewall identity: a client certificate with this CN and no group, bound only to
# the read-only ClusterRole below.
KUBE_ROUTER_USER = "system:dllm:kube-router"
KUBE_ROUTER_ROLE = "dllm:kube-router-firewall"
# Logged by kube-router after each successful iptables-restore of its policy chains: the first one means
# the rules of every NetworkPolicy present at start are in force.
KUBE_ROUTER_SYNCED = "Restoring IPv4 iptables rules took"


def kube_router_args(paths: NodePaths) -> list[str]:
    """Only the firewall: routes come from the bridge CNI and Services from kube-proxy."""
    return [
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--run-loadbalancer=false",
        f"--kubeconfig={paths.kubeconfig('kube-router')}", f"--hostname-override={NODE_NAME}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--enable-ipv4=true", "--enable-ipv6=false",
        # Its health server shares Go's default mux with net/http/pprof, on every address of the node:
        # pods could read its profiles. Metrics off too: nothing listens.
        "--health-port=0", "--metrics-port=0",
        "--iptables-sync-period=5m", "--v=1",
    ]  # fmt: skip


def kube_router_rbac() -> str:
    """Read-only access to what its informers list and watch. Its informer factory starts informers for
    Services, Endpoints and EndpointSlices even with only the firewall on, and waits for all of them to
    sync, so those are read too; it gets its own Node for the node IP. No write verb anywhere."""
    watch, core = ["get", "list", "watch"], ["pods", "namespaces", "nodes", "services", "endpoints"]
    rules = [
        {"apiGroups": [""], "resources": core, "verbs": watch},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": watch},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": watch},
    ]  # fmt: skip
    rbac, name = "rbac.authorization.k8s.io", KUBE_ROUTER_ROLE
    items = [
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules},
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
         "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": name},
         "subjects": [{"apiGroup": rbac, "kind": "User", "name": KUBE_ROUTER_USER}]},
    ]  # fmt: skip
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


COREFILE = """.:53 {
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
}
"""


def coredns_manifests(image: str) -> str:
    """ServiceAccount, RBAC, Corefile, a Deployment pinned to the real node and the kube-dns Service.

    No `forward` plugin: names outside cluster.local fail, so no query leaves the machine."""
    ns, app = "kube-system", {"k8s-app": "kube-dns"}
    meta = {"name": "coredns", "namespace": ns}
    rules = [
        {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
         "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]  # fmt: skip
    dns_ports = [{"name": f"dns-{p.lower()}", "port": 53, "protocol": p} for p in ("UDP", "TCP")]
    probe = {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2}
    container = {
        "name": "coredns", "image": image, "imagePullPolicy": "Never",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "ports": [{"containerPort": 53, "protocol": p, "name": f"dns-{p.lower()}"} for p in ("UDP", "TCP")],
        "readinessProbe": probe,
        "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 10},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
    }  # fmt: skip
    pod_spec = {
        "serviceAccountName": "coredns", "dnsPolicy": "Default",
        "priorityClassName": "system-cluster-critical",
        "nodeSelector": dict([LABEL]), "tolerations": [{**TAINT, "operator": "Equal"}],
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
    }  # fmt: skip
    items: list[dict[str, object]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "dllm:coredns"}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "dllm:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "dllm:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": ns}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": app},
         "spec": {"replicas": 1, "selector": {"matchLabels": app},
                  "template": {"metadata": {"labels": app}, "spec": pod_spec}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": ns, "labels": app},
         "spec": {"clusterIP": DNS_IP, "selector": app, "ports": dns_ports}},
    ]  # fmt: skip
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
