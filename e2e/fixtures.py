"""Pytest fixtures for suites that need Kubernetes: a session-wide cluster, a namespace per test.

By default the cluster is the local control plane (e2e/cluster), started if it is not running and
stopped afterwards if this session started it. Any other cluster is refused unless the user opts in:
DLLM_E2E_KUBECONFIG=path plus DLLM_E2E_ALLOW_CONTEXT=<its current context> (kind, a GPU cluster).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import node_images
from e2e.cluster import controlplane as cp
from e2e.cluster import node, probepod

LOCAL_CONTEXT = "dllm-local"

_PAUSE = threading.Event()  # never set: wait(t) is an interruptible pause


class WaitTimeout(AssertionError):
    pass


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `check` until it returns a truthy value; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        _PAUSE.wait(interval)  # poll interval of a bounded wait


def holds_for(check: Callable[[], Any], seconds: float, interval: float = 1.0) -> Any:
    """Watch `check` for `seconds`; return its first truthy value (a violation) or the last falsy one."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        _PAUSE.wait(interval)


@dataclass
class Cluster:
    """A cluster the tests may use: its kubeconfig, kubectl and (for the local one) its layout."""

    kubeconfig: Path
    layout: cp.Layout | None

    @property
    def kubectl_path(self) -> str:
        return str(self.layout.kubectl) if self.layout else "kubectl"

    @property
    def helm_path(self) -> str:
        return str(self.layout.tools_bin / "helm") if self.layout else "helm"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        if self.layout:
            env["PATH"] = f"{self.layout.tools_bin}:{env['PATH']}"
        return env

    def _tool(
        self, binary: str, args: tuple[str, ...], input_text: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [binary, *args], input=input_text, capture_output=True, text=True, env=self.env(),
            timeout=timeout, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            name = Path(binary).name
            raise AssertionError(f"{name} {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def run(
        self, *args: str, input_text: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._tool(self.kubectl_path, args, input_text, check, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self._tool(self.helm_path, args, None, check, timeout)

    def set_pod_ready(self, namespace: str, pod: str, ready: bool, message: str = "") -> None:
        """Flip a pod's Ready condition, as a failing readiness probe would (kwok runs no probes)."""
        condition = {"type": "Ready", "status": "True" if ready else "False",
                     "reason": "" if ready else "ReadinessProbeFailed", "message": message}  # fmt: skip
        patch = json.dumps({"status": {"conditions": [condition]}})
        self.run(
            "patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=strategic", "-p", patch
        )

    def get_json(self, *args: str) -> dict[str, Any]:
        return dict(json.loads(self.run("get", *args, "-o", "json").stdout))

    def apply(self, manifest: dict[str, Any] | str, *extra: str) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.run("apply", "--server-side", "--field-manager=e2e", "-f", "-", *extra, input_text=text)

    def exists(self, *args: str) -> bool:
        return self.run("get", *args, "--ignore-not-found", "-o", "name", check=False).stdout.strip() != ""

    def token_kubeconfig(self, token: str, path: Path) -> Path:
        """A kubeconfig for the same server that authenticates with only this bearer token."""
        config = json.loads(self.run("config", "view", "--raw", "--minify", "-o", "json").stdout)
        cluster_entry = config["clusters"][0]
        config["users"] = [{"name": "token-user", "user": {"token": token}}]
        config["contexts"] = [
            {"name": "token", "context": {"cluster": cluster_entry["name"], "user": "token-user"}}
        ]
        config["current-context"] = "token"
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    def as_token(self, token: str, path: Path, *args: str) -> subprocess.CompletedProcess[str]:
        kubeconfig = self.token_kubeconfig(token, path)
        return subprocess.run(
            [self.kubectl_path, f"--kubeconfig={kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env(),
            check=False,
        )

    def audit_entries(self) -> list[dict[str, Any]]:
        if self.layout is None:
            raise pytest.skip.Exception("the audit log is only readable on the local control plane")
        lines = self.layout.audit_log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


OPERATOR_AGENTS = ("dllm-operator/", "kopf/")


@pytest.fixture
def real_node(cluster: Cluster) -> cp.Layout:
    """The local cluster's layout, its real node running; the test is skipped where there is none."""
    if cluster.layout is None or not node.running(cluster.layout):
        pytest.skip("the real node is not running (needs root and `make cluster-build`; DLLM_CP_REAL_NODE)")
    return cluster.layout


def operator_writes(entries: list[dict[str, Any]], namespaces: set[str], since: str) -> list[dict[str, Any]]:
    """Audit-log writes of the operator (its client or kopf) in `namespaces` after `since`, no leases."""
    return [
        e for e in entries
        if e.get("userAgent", "").startswith(OPERATOR_AGENTS)
        and e.get("objectRef", {}).get("namespace") in namespaces
        and e.get("objectRef", {}).get("resource") != "leases"
        and e.get("requestReceivedTimestamp", "") > since
    ]  # fmt: skip


def _current_context(kubeconfig: str) -> str:
    """The kubeconfig's current-context, read from the file itself (no kubectl needed); "" if none."""
    try:
        config = yaml.safe_load(Path(kubeconfig).read_text())
    except (OSError, yaml.YAMLError):
        return ""
    return str(config.get("current-context") or "") if isinstance(config, dict) else ""


def _foreign_cluster() -> Cluster | None:
    kubeconfig = os.environ.get("DLLM_E2E_KUBECONFIG")
    if not kubeconfig:
        return None
    allowed = os.environ.get("DLLM_E2E_ALLOW_CONTEXT", "")
    context = _current_context(kubeconfig)
    if not allowed or context != allowed:
        raise pytest.UsageError(
            f"refusing to run against kube context {context!r} of {kubeconfig}: set "
            f"DLLM_E2E_ALLOW_CONTEXT={context} to allow it (tests create and delete objects)"
        )
    return Cluster(Path(kubeconfig), None)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    foreign = _foreign_cluster()
    if foreign is not None:
        yield foreign
        return
    layout = cp.Layout.from_env()
    started = set(cp.running_components(layout)) != set(cp.COMPONENTS)
    try:
        cp.up()
    except cp.ClusterError as error:
        pytest.fail(f"local control plane: {error}")
    if _current_context(str(layout.kubeconfig)) != LOCAL_CONTEXT:
        pytest.fail(f"{layout.kubeconfig} is not the local control plane's kubeconfig")
    # The node tier comes last: its images load meanwhile (minutes for a fresh build, nothing when warm).
    node_images.preload(layout, log=lambda line: print(line, file=sys.__stderr__))
    yield Cluster(layout.kubeconfig, layout)
    if started and not os.environ.get("DLLM_E2E_KEEP_CLUSTER"):
        cp.down()


def namespace_name(nodeid: str) -> str:
    digest = hashlib.sha256(nodeid.encode()).hexdigest()[:8]
    stem = "".join(ch if ch.isalnum() else "-" for ch in nodeid.rsplit("::", 1)[-1].lower())[:40].strip("-")
    return f"t-{stem}-{digest}"


def _fresh_namespace(cluster: Cluster, name: str, delete_timeout: str) -> Iterator[str]:
    cluster.run(
        "delete", "namespace", name, "--ignore-not-found", "--wait=true", f"--timeout={delete_timeout}"
    )
    cluster.run("create", "namespace", name)
    wait_until(
        lambda: cluster.exists("serviceaccount", "default", "-n", name),
        30,
        f"the default ServiceAccount in {name}",
    )
    yield name
    cluster.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted (without waiting) afterwards."""
    yield from _fresh_namespace(cluster, namespace_name(request.node.nodeid), "60s")


@pytest.fixture
def other_namespace(cluster: Cluster, namespace: str) -> Iterator[str]:
    """A second fresh namespace beside the test's own."""
    yield from _fresh_namespace(cluster, f"{namespace}-other", "120s")


# ---- probe pods on the real node (the node tests' servers and clients) -------------------------------

# Outcomes of `probe dial` that mean the connection was not made: kube-router REJECTs (an ICMP port
# unreachable, which the client sees at once as 'connection refused'); a DROP would be a timeout.
BLOCKED = ("refused", "timeout")
DIAL_SECONDS = 3


def pod_ready(cluster: Cluster, pod: str, namespace: str) -> bool:
    conditions = cluster.get_json("pod", pod, "-n", namespace).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def start_probe_servers(
    cluster: Cluster, layout: cp.Layout, pods: list[tuple[str, str, dict[str, str]]]
) -> None:
    """Probe servers (name, namespace, labels) on the real node, all Ready."""
    image = node.probe_image(layout)
    for name, namespace, labels in pods:
        cluster.apply(probepod.server(name, namespace, image, labels))
    for name, namespace, _ in pods:
        wait_until(
            functools.partial(pod_ready, cluster, name, namespace), 120, f"pod {namespace}/{name} Ready"
        )


def probe_dial(cluster: Cluster, pod: str, namespace: str, *addrs: str) -> dict[str, str]:
    """`probe dial` from inside a probe pod: each address's outcome (open, refused, timeout, error ...)."""
    result = cluster.run(
        "exec", pod, "-n", namespace, "--", "/probe", "dial", str(DIAL_SECONDS), *addrs, timeout=300
    )
    outcomes = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.strip())
    assert set(outcomes) == set(addrs), result.stdout
    return outcomes


CRD_FILE = Path(__file__).resolve().parents[1] / "crds" / "disaggregatedllms.disagg.dev.yaml"


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> str:
    """The DisaggregatedLLM CRD, applied server-side (it is large) and Established."""
    cluster.run("apply", "--server-side", "--force-conflicts", "--field-manager=e2e", "-f", str(CRD_FILE))
    name = "disaggregatedllms.disagg.dev"
    cluster.run("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return name
