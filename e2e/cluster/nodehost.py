"""The real node's footprint on the machine: its network namespace, veth pair and host routes, its cgroups,
and the sweeps that remove all of it (processes, mounts, cgroups, links) even after a crash.

Every function here is idempotent: it does what is still to do and ignores what is already gone."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from e2e.cluster import nodeconfig as nc
from e2e.cluster.controlplane import ClusterError, pid_alive, wait_for

NETNS_PATH = Path("/run/netns") / nc.NETNS
HOST_ROUTES = (nc.POD_CIDR, nc.SERVICE_CIDR)
_MNT_DETACH = 2


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def in_netns(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # nsenter --net, not `ip netns exec`: the latter remounts /sys and hides the cgroup mounts.
    return run("nsenter", f"--net={NETNS_PATH}", *argv, check=check)


# ---- network ---------------------------------------------------------------------------------------


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def create_network() -> None:
    """Namespace, veth pair (host 10.250.0.1 <-> node 10.250.0.2), and host routes to pods and Services."""
    run("ip", "netns", "add", nc.NETNS)
    run("ip", "link", "add", nc.HOST_VETH, "type", "veth", "peer", "name", nc.NODE_VETH, "netns", nc.NETNS)
    Path(f"/proc/sys/net/ipv6/conf/{nc.HOST_VETH}/disable_ipv6").write_text("1")
    run("ip", "addr", "add", f"{nc.HOST_IP}/30", "dev", nc.HOST_VETH)
    run("ip", "link", "set", nc.HOST_VETH, "up")
    in_netns("ip", "link", "set", "lo", "up")
    in_netns("ip", "addr", "add", f"{nc.NODE_IP}/30", "dev", nc.NODE_VETH)
    in_netns("ip", "link", "set", nc.NODE_VETH, "up")
    # Pods route through the node's namespace; bridged replies must pass kube-proxy's conntrack.
    # kube-router REJECTs what a NetworkPolicy refuses with an ICMP port unreachable, which the kernel
    # rate-limits per destination (one a second): a client trying many ports would see most refusals
    # as timeouts. This namespace's own limit is lifted (the global per-second cap stays).
    for key in (
        "net.ipv4.ip_forward=1",
        "net.bridge.bridge-nf-call-iptables=1",
        "net.ipv6.conf.all.disable_ipv6=1",
        "net.ipv4.icmp_ratelimit=0",
    ):
        in_netns("sysctl", "-qw", key)
    for cidr in HOST_ROUTES:
        run("ip", "route", "replace", cidr, "via", nc.NODE_IP, "dev", nc.HOST_VETH)


def delete_network() -> None:
    for cidr in HOST_ROUTES:
        if run("ip", "route", "show", cidr, "via", nc.NODE_IP, check=False).stdout.strip():
            run("ip", "route", "del", cidr, "via", nc.NODE_IP, check=False)
    if link_exists(nc.HOST_VETH):
        run("ip", "link", "del", nc.HOST_VETH)
    if NETNS_PATH.exists():
        run("ip", "netns", "del", nc.NETNS)


# ---- processes -------------------------------------------------------------------------------------


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield int(entry.name)


def pids_in_netns() -> list[int]:
    """Processes whose network namespace is the node's (containerd, shims, kubelet, kube-proxy)."""
    try:
        target = os.stat(NETNS_PATH)
    except OSError:
        return []
    found = []
    for pid in _pids():
        try:
            ns = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if (ns.st_dev, ns.st_ino) == (target.st_dev, target.st_ino):
            found.append(pid)
    return found


def pids_running(binaries: list[Path]) -> list[int]:
    """Processes running one of these exact executables (a shim left after its namespace went away)."""
    wanted = {str(b) for b in binaries}
    found = []
    for pid in _pids():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if exe.removesuffix(" (deleted)") in wanted:
            found.append(pid)
    return found


def kill_all(pids: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 20, f"{len(pids)} node processes to end")


# ---- cgroups ---------------------------------------------------------------------------------------


def mountinfo() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, mount points unescaped."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        point = fields[4].encode().decode("unicode_escape")
        mounts.append((point, fields[fields.index("-") + 1]))
    return mounts


def cgroup_roots() -> list[Path]:
    return [Path(p) / nc.CGROUP for p, fstype in mountinfo() if fstype in ("cgroup", "cgroup2")]


def create_cgroups() -> None:
    for root in cgroup_roots():
        root.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset children start empty
            own, parent = root / name, root.parent / name
            if own.exists() and not own.read_text().strip():
                own.write_text(parent.read_text())


def cgroup_pids() -> list[int]:
    pids: set[int] = set()
    for root in cgroup_roots():
        for folder, _, _ in os.walk(root):
            try:
                pids.update(int(p) for p in Path(folder, "cgroup.procs").read_text().split())
            except OSError:
                continue
    return sorted(pids)


def remove_cgroups() -> None:
    def removed() -> bool:
        for root in cgroup_roots():
            for folder, _, _ in os.walk(root, topdown=False):
                try:
                    os.rmdir(folder)
                except FileNotFoundError:
                    continue
                except OSError:
                    kill_all(cgroup_pids())
                    return False
        return True

    wait_for(removed, 30, f"the {nc.CGROUP} cgroups to be removed")


# ---- mounts ----------------------------------------------------------------------------------------


def unmount_below(folder: Path) -> int:
    """Detach every mount at or below folder, deepest first; returns how many."""
    libc = ctypes.CDLL(None, use_errno=True)
    prefix = str(folder).rstrip("/") + "/"
    points = sorted(
        {p for p, _ in mountinfo() if p == prefix[:-1] or p.startswith(prefix)}, key=len, reverse=True
    )
    for point in points:
        if libc.umount2(point.encode(), _MNT_DETACH) != 0:
            errno = ctypes.get_errno()
            if errno not in (22, 2):  # EINVAL: no longer a mount point; ENOENT: gone
                raise ClusterError(f"umount {point}: {os.strerror(errno)}")
    return len(points)


# ---- shim sockets ----------------------------------------------------------------------------------

SHIM_SOCKETS = Path("/run/containerd/s")  # fixed in containerd's shim code, not configurable


def shim_sockets() -> list[str]:
    return sorted(p.name for p in SHIM_SOCKETS.iterdir()) if SHIM_SOCKETS.is_dir() else []


def remove_shim_sockets(keep: set[str]) -> None:
    """Drop shim sockets that appeared since `keep` was taken and that no live process in this
    namespace listens on (the shims ran in the node's namespace, now gone)."""
    bound = {line.rsplit(" ", 1)[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    for name in set(shim_sockets()) - keep:
        if str(SHIM_SOCKETS / name) not in bound:
            (SHIM_SOCKETS / name).unlink(missing_ok=True)
    for folder in (SHIM_SOCKETS, SHIM_SOCKETS.parent):
        with contextlib.suppress(OSError):  # only when empty and not there before the node
            if not keep and not any(folder.iterdir()):
                folder.rmdir()
