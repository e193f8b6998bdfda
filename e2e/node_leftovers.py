"""What a deployment leaves on the real node after it is removed: compared with the node before it.

Read from the node itself: containerd's containers and sandboxes of the namespaces it used, the pod
veths, host-local IP allocations whose container is gone (a leak that exhausts the pod range over
runs), and kube-router's chains and ipsets (one set per NetworkPolicy and pod).
"""

from __future__ import annotations

from collections.abc import Iterable

from e2e.cluster import controlplane as cp
from e2e.cluster import node, nodehost
from e2e.cluster import nodeconfig as nc

State = dict[str, frozenset[str]]


def snapshot(layout: cp.Layout, namespaces: Iterable[str]) -> State:
    containers = frozenset(node.ctr(layout, "containers", "ls", "-q").split())
    ours = frozenset(
        f"{namespace}/{cid}"
        for namespace in namespaces
        for cid in node.ctr(
            layout, "containers", "ls", "-q", f'labels."io.kubernetes.pod.namespace"=={namespace}'
        ).split()
    )
    allocations = node.paths_of(layout).cni_ipam / nc.CNI_NETWORK
    owners = {path.name: path.read_text().split()[:1] for path in allocations.glob("*.*.*.*")}
    leaked = frozenset(ip for ip, owner in owners.items() if owner and owner[0] not in containers)
    links = nodehost.in_netns("ip", "-o", "link", "show", "type", "veth").stdout.splitlines()
    veths = frozenset(line.split(":")[1].strip().split("@")[0] for line in links if ":" in line)
    rules = nodehost.in_netns("iptables-save").stdout.splitlines()
    chains = frozenset(line.split()[0][1:] for line in rules if line.startswith(":KUBE-NWPLCY-"))
    ipsets = frozenset(
        name for name in nodehost.in_netns("ipset", "list", "-n").stdout.split() if "KUBE-" in name
    )
    return {
        "containers of ours": ours,
        "IP allocations without a container": leaked,
        "veths": veths,
        "kube-router policy chains": chains,
        "kube-router ipsets": ipsets,
    }


def added(before: State, after: State) -> dict[str, list[str]]:
    """What `after` holds that `before` did not (every kind; empty when nothing was left)."""
    return {
        kind: sorted(after[kind] - before.get(kind, frozenset()))
        for kind in after
        if after[kind] - before.get(kind, frozenset())
    }
