"""tools/system-deps.sh: what a step needs from Debian is installed, or the exact command is printed."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "system-deps.sh"

# A dpkg-query double that reports every package as not installed (test double: the machine running the
# tests has them all, and must not lose them to prove the message).
DPKG_QUERY_NOTHING_INSTALLED = "#!/bin/sh\nexit 1\n"


def _run_as_nobody(*groups: str) -> subprocess.CompletedProcess[str]:
    """The script fed on stdin to bash running as nobody, with the dpkg-query double first on PATH."""
    with tempfile.TemporaryDirectory() as bin_dir:
        Path(bin_dir).chmod(0o755)  # nobody must reach the double
        double = Path(bin_dir) / "dpkg-query"
        double.write_text(DPKG_QUERY_NOTHING_INSTALLED)
        double.chmod(0o755)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/nonexistent"}
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-s", *groups]
        return subprocess.run(
            argv, input=SCRIPT.read_text(), env=env, capture_output=True, text=True, timeout=60, check=False
        )


def test_not_root_it_stops_at_once_with_the_exact_command() -> None:
    assert os.geteuid() == 0, "the test switches to nobody, which needs root"
    result = _run_as_nobody("engine")
    assert result.returncode == 1
    assert "libibverbs1 ibverbs-providers libnuma1 libcurl4" in result.stderr
    assert "apt-get update && apt-get" in result.stderr
    assert "install -y --no-install-recommends libibverbs1" in result.stderr


def test_the_real_node_group_names_the_netfilter_tools_its_firewall_runs() -> None:
    """kube-router execs iptables-save/-restore and ipset: a fresh machine must get them with the node's."""
    result = _run_as_nobody("node")
    assert result.returncode == 1
    assert "runc iptables ipset conntrack" in result.stderr


def test_an_unknown_group_is_refused() -> None:
    result = _run_as_nobody("engine", "gpu-drivers")
    assert result.returncode == 2
    assert "unknown group 'gpu-drivers'" in result.stderr


def test_nothing_missing_does_nothing() -> None:
    """On this machine every group is installed (make test installed them): a no-op, silent."""
    result = subprocess.run(
        ["bash", SCRIPT, "engine"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0
    assert result.stderr == ""


def test_the_images_group_brings_the_network_backend_that_containers_conf_names() -> None:
    """images/containers.conf names netavark: without it podman refuses even to import the base image."""
    conf = (ROOT / "images" / "containers.conf").read_text()
    assert 'network_backend = "netavark"' in conf
    result = _run_as_nobody("images")
    assert result.returncode == 1
    assert " netavark aardvark-dns" in result.stderr
