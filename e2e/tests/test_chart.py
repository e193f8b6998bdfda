"""The Helm chart on the real local control plane: lint, server dry-run, install/upgrade/uninstall,
least-privilege RBAC proven by running the operator as the chart's ServiceAccount, Pod Security, the RDMA
device plugin's placement, and values.schema.json refusals."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e import dashboard
from e2e.fixtures import Cluster, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import cpu_sample_on_kwok

from dllm_operator.api import parse
from dllm_operator.render import render_all

pytestmark = pytest.mark.k8s
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dllm-operator"


@pytest.fixture
def watched(cluster: Cluster, namespace: str) -> Iterator[str]:
    """A second namespace: the one the operator manages (the test namespace holds the release)."""
    name = f"{namespace[:50]}-w"
    cluster.run("create", "namespace", name)
    yield name
    cluster.run("delete", "namespace", name, "--wait=false", check=False)


def release(namespace: str) -> str:
    return f"r{namespace[-8:]}"  # unique per test: cluster-scoped RBAC names include it


@pytest.fixture
def uninstalled(cluster: Cluster, namespace: str) -> Iterator[str]:
    """The test's release, uninstalled afterwards: its admission policies and RBAC are cluster-scoped."""
    yield release(namespace)
    cluster.helm("uninstall", release(namespace), "-n", namespace, "--ignore-not-found", check=False)


def sa_token(cluster: Cluster, namespace: str) -> str:
    sa = f"{release(namespace)}-dllm-operator"
    return cluster.run("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()


def can_i(cluster: Cluster, kubeconfig: Path, *args: str) -> bool:
    result = cluster.run(f"--kubeconfig={kubeconfig}", "auth", "can-i", *args, check=False)
    return result.stdout.strip() == "yes"


def test_chart_lints(cluster: Cluster) -> None:
    result = cluster.helm("lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_crd_is_the_source_crd() -> None:
    source = ROOT / "crds" / "disaggregatedllms.disagg.dev.yaml"
    assert (CHART / "crds" / source.name).read_text() == source.read_text(), "run `make crds`"


def rendered_kinds(cluster: Cluster, *args: str) -> dict[str, list[dict[str, Any]]]:
    """`helm template` of the chart with these flags, its documents by kind."""
    out = cluster.helm("template", "r", str(CHART), "-n", "ops", *args).stdout
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(out):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def test_a_disruption_budget_only_with_two_replicas_and_a_service_monitor_only_where_its_api_is(
    cluster: Cluster,
) -> None:
    default = rendered_kinds(cluster)
    assert "PodDisruptionBudget" not in default  # one replica: a budget would block every node drain
    assert "ServiceMonitor" not in default
    [pdb] = rendered_kinds(cluster, "--set", "replicaCount=2")["PodDisruptionBudget"]
    [deployment] = default["Deployment"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    monitor = ("--set", "metrics.serviceMonitor.enabled=true")
    assert "ServiceMonitor" not in rendered_kinds(cluster, *monitor)  # no Prometheus operator: none
    api = ("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    [service_monitor] = rendered_kinds(cluster, *monitor, *api)["ServiceMonitor"]
    [service] = default["Service"]
    # It selects the operator's Service by that Service's own labels, and scrapes its named port.
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = service_monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}


def test_the_dashboard_and_the_pod_monitor_are_opt_in_and_match_what_the_operator_renders(
    cluster: Cluster,
) -> None:
    default = rendered_kinds(cluster)
    assert "ConfigMap" not in default
    assert "PodMonitor" not in default
    [config_map] = rendered_kinds(cluster, "--set", "metrics.dashboard.enabled=true")["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar picks it up
    assert json.loads(config_map["data"]["dllm.json"]) == dashboard.load()
    monitor = ("--set", "metrics.podMonitor.enabled=true")
    assert "PodMonitor" not in rendered_kinds(cluster, *monitor)  # no Prometheus operator: none
    api = ("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    [pod_monitor] = rendered_kinds(cluster, *monitor, *api)["PodMonitor"]
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    # It selects every pod the operator renders for a resource (engines and router), by their own
    # labels and port name, and keeps the labels the dashboard filters on.
    children = render_all(parse(cpu_sample_on_kwok()))
    templates = [c["spec"]["template"] for c in children if c["kind"] in ("StatefulSet", "Deployment")]
    assert len(templates) == 3
    for template in templates:
        labels = template["metadata"]["labels"]
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert endpoint["port"] in {port["name"] for port in template["spec"]["containers"][0]["ports"]}
        assert set(pod_monitor["spec"]["podTargetLabels"]) <= labels.keys()
    assert set(pod_monitor["spec"]["podTargetLabels"]) == {
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
    }
    scoped = rendered_kinds(cluster, *monitor, *api, "--set", "watchNamespaces={team-a,team-b}")
    assert scoped["PodMonitor"][0]["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def leaf_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the values' leaves (a scalar, a list or an empty map)."""
    paths: list[str] = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths += leaf_paths(value, path + ".") if isinstance(value, dict) and value else [path]
    return paths


def test_values_yaml_documents_every_value() -> None:
    """Each value, or a map holding it (resources), has a `# path -- what it is` comment, and every
    such comment names a value that exists."""
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"^\s*# ([\w.]+) -- ", text, flags=re.MULTILINE))
    values = yaml.safe_load(text)
    undocumented = [
        path
        for path in leaf_paths(values)
        if not any(path == name or path.startswith(name + ".") for name in documented)
    ]
    assert undocumented == []
    assert all(key in documented for key in values), sorted(set(values) - documented)
    every_path = {p for leaf in leaf_paths(values) for p in _prefixes(leaf)}
    assert sorted(documented - every_path) == []


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def test_rendered_chart_passes_server_dry_run(
    cluster: Cluster, crd: str, namespace: str, watched: str
) -> None:
    rendered = cluster.helm(
        "template",
        release(namespace),
        str(CHART),
        "-n",
        namespace,
        "--set",
        f"watchNamespaces={{{watched}}}",
        "--set",
        "rdmaDevicePlugin.enabled=true",
        "--set",
        "replicaCount=2",
    ).stdout
    result = cluster.run("apply", "--dry-run=server", "-f", "-", input_text=rendered)
    kinds = {line.split("/")[0] for line in result.stdout.splitlines()}
    assert {
        "deployment.apps",
        "pod",
        "role.rbac.authorization.k8s.io",
        "daemonset.apps",
        "poddisruptionbudget.policy",
        "validatingadmissionpolicy.admissionregistration.k8s.io",
        "validatingadmissionpolicybinding.admissionregistration.k8s.io",
    } <= kinds  # the helm test hook pod included


def test_install_upgrade_uninstall(cluster: Cluster, crd: str, namespace: str) -> None:
    name = release(namespace)
    cluster.helm("install", name, str(CHART), "-n", namespace, "--wait", "--timeout=120s")
    deploy = cluster.get_json("deployment", f"{name}-dllm-operator", "-n", namespace)
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["run", "--all-namespaces"]
    cluster.helm(
        "upgrade", name, str(CHART), "-n", namespace, "--set", "logLevel=DEBUG", "--wait", "--timeout=120s"
    )
    deploy = cluster.get_json("deployment", f"{name}-dllm-operator", "-n", namespace)
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DLLM_LOG_LEVEL"] == "DEBUG"
    assert deploy["metadata"]["generation"] == 2
    cluster.helm("uninstall", name, "-n", namespace, "--wait", "--timeout=120s")
    assert not cluster.exists("deployment", f"{name}-dllm-operator", "-n", namespace)
    assert not cluster.exists("clusterrole", f"{name}-dllm-operator")


def test_chart_identity_reconciles_and_nothing_more(
    cluster: Cluster, crd: str, namespace: str, watched: str, tmp_path: Path, uninstalled: str
) -> None:
    """Namespaced mode: the chart's ServiceAccount, out of cluster, runs the operator to Ready."""
    name = release(namespace)
    cluster.helm("install", name, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{watched}}}")
    kubeconfig = cluster.token_kubeconfig(sa_token(cluster, namespace), tmp_path / "sa.kubeconfig")
    operator = OperatorProcess(
        kubeconfig, [watched], tmp_path / "op.log", namespace, extra_args=("--lease-name", "dllm-operator")
    ).start()
    try:
        cluster.apply(cpu_sample_on_kwok(), "-n", watched)

        def ready() -> bool:
            cr = cluster.get_json("dllm", "tiny-cpu", "-n", watched)
            return any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in cr.get("status", {}).get("conditions", [])
            )

        wait_until(
            ready, 60, f"tiny-cpu Ready, reconciled as the chart's ServiceAccount ({operator.log_path})"
        )
        # No call was refused on the way: a refusal is logged as "403 Forbidden: ..." (kube.ApiError).
        assert "403 Forbidden" not in operator.log_text()
    finally:
        operator.stop()
    assert can_i(cluster, kubeconfig, "patch", "statefulsets", "-n", watched)
    assert can_i(cluster, kubeconfig, "patch", "networkpolicies.networking.k8s.io", "-n", watched)
    assert can_i(cluster, kubeconfig, "create", "secrets", "-n", watched)  # the auth Secret, once
    assert not can_i(cluster, kubeconfig, "get", "secrets", "-n", watched)
    assert not can_i(cluster, kubeconfig, "patch", "secrets", "-n", watched)
    assert not can_i(cluster, kubeconfig, "list", "secrets", "-n", namespace)
    assert not can_i(cluster, kubeconfig, "list", "statefulsets", "-n", "default")
    assert not can_i(cluster, kubeconfig, "create", "clusterroles")
    assert not can_i(cluster, kubeconfig, "update", "disaggregatedllms", "-n", watched)  # status only
    assert not can_i(cluster, kubeconfig, "delete", "pods", "-n", watched)
    assert can_i(cluster, kubeconfig, "update", "leases/dllm-operator", "-n", namespace)
    assert not can_i(cluster, kubeconfig, "update", "leases/kube-scheduler", "-n", namespace)
    rules = cluster.get_json("role", name + "-dllm-operator", "-n", watched)["rules"]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)


def test_cluster_mode_identity_has_no_secret_access(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    name = release(namespace)
    cluster.helm("install", name, str(CHART), "-n", namespace)
    try:
        kubeconfig = cluster.token_kubeconfig(sa_token(cluster, namespace), tmp_path / "sa.kubeconfig")
        assert can_i(cluster, kubeconfig, "watch", "disaggregatedllms", "--all-namespaces")
        assert can_i(cluster, kubeconfig, "create", "statefulsets", "-n", "default")
        assert not can_i(cluster, kubeconfig, "get", "secrets", "--all-namespaces")
        assert not can_i(cluster, kubeconfig, "create", "clusterrolebindings")
        assert not can_i(cluster, kubeconfig, "list", "nodes")
    finally:
        cluster.helm("uninstall", name, "-n", namespace, check=False)


def test_operator_identity_writes_only_what_its_resources_ask_for(
    cluster: Cluster, crd: str, namespace: str, watched: str, tmp_path: Path
) -> None:
    """M6: whatever its RBAC allows, the chart's admission policies let the operator's ServiceAccount
    write only managed children of a DisaggregatedLLM: no Service externalIPs, no LoadBalancer the
    resource did not ask for, no host network unless the namespace opts in."""
    name = release(namespace)
    cluster.helm("install", name, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{watched}}}")
    try:
        kubeconfig = cluster.token_kubeconfig(sa_token(cluster, namespace), tmp_path / "sa.kubeconfig")
        check_operator_writes(cluster, kubeconfig, watched)
    finally:  # the policies are cluster-scoped: never leave them behind
        cluster.helm("uninstall", name, "-n", namespace, "--wait", check=False)


def check_operator_writes(cluster: Cluster, kubeconfig: Path, watched: str) -> None:
    def as_operator(obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return cluster.run(
            f"--kubeconfig={kubeconfig}", "create", "--dry-run=server", "-n", watched, "-f", "-",
            input_text=json.dumps(obj), check=False,
        )  # fmt: skip

    cluster.apply(cpu_sample_on_kwok(), "-n", watched)
    body = copy.deepcopy(cluster.get_json("dllm", "tiny-cpu", "-n", watched))
    rendered = {(m["kind"], m["metadata"]["name"]): m for m in render_all(parse(body))}
    service, router = rendered[("Service", "tiny-cpu-router")], rendered[("Deployment", "tiny-cpu-router")]
    on_host = copy.deepcopy(router)
    on_host["spec"]["template"]["spec"]["hostNetwork"] = True
    refused = {
        "externalIPs": {**service, "spec": {**service["spec"], "externalIPs": ["10.0.0.1"]}},
        "LoadBalancer": {**service, "spec": {**service["spec"], "type": "LoadBalancer"}},
        "managed-by": {**service, "metadata": {**service["metadata"], "labels": {"app": "x"}}},
        "host namespaces": on_host,
    }
    wait_until(lambda: as_operator(refused["externalIPs"]).returncode != 0, 30, "the policies in force")
    wait_until(lambda: as_operator(refused["LoadBalancer"]).returncode != 0, 30, "the resource as a param")
    for obj in rendered.values():  # what the operator renders passes
        result = as_operator(obj)
        assert result.returncode == 0, result.stderr
    for what, obj in refused.items():
        result = as_operator(obj)
        assert result.returncode != 0, f"{what} was admitted"
        assert what in result.stderr, result.stderr
    patch = json.dumps({"spec": {"router": {"serviceType": "LoadBalancer"}}})
    cluster.run("patch", "dllm", "tiny-cpu", "-n", watched, "--type=merge", "-p", patch)
    wait_until(
        lambda: as_operator(refused["LoadBalancer"]).returncode == 0, 30, "the LoadBalancer it asks for"
    )


def test_operator_pod_is_admitted_under_restricted_pod_security(
    cluster: Cluster, crd: str, namespace: str, uninstalled: str
) -> None:
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    name = release(namespace)
    cluster.helm("install", name, str(CHART), "-n", namespace, "--set", f"watchNamespaces={{{namespace}}}")

    def running_pod() -> bool:
        pods = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/name=dllm-operator")[
            "items"
        ]
        return any(p["status"].get("phase") == "Running" for p in pods)

    wait_until(running_pod, 60, "the operator pod to be admitted and running")
    events = cluster.get_json("events", "-n", namespace)["items"]
    assert not [e for e in events if e["reason"] == "FailedCreate"]


def test_device_plugin_lands_only_on_labelled_nodes(
    cluster: Cluster, crd: str, namespace: str, uninstalled: str
) -> None:
    label = "feature.node.kubernetes.io/rdma.capable"
    cluster.run("label", "node", "gpu-node-1", f"{label}=true", "--overwrite")
    name = release(namespace)
    try:
        cluster.helm(
            "install",
            name,
            str(CHART),
            "-n",
            namespace,
            "--set",
            f"watchNamespaces={{{namespace}}}",
            "--set",
            "rdmaDevicePlugin.enabled=true",
            "--set",
            "rdmaDevicePlugin.deviceIds={101b}",
        )
        ds_name = f"{name}-dllm-operator-rdma-device-plugin"

        def placed() -> list[str]:
            pods = cluster.get_json(
                "pods", "-n", namespace, "-l", "app.kubernetes.io/component=rdma-device-plugin"
            )["items"]
            return sorted(p["spec"].get("nodeName", "") for p in pods)

        assert wait_until(lambda: placed() == ["gpu-node-1"], 60, "one plugin pod on gpu-node-1")
        ds = cluster.get_json("daemonset", ds_name, "-n", namespace)
        assert ds["status"]["desiredNumberScheduled"] == 1
        config = json.loads(cluster.get_json("configmap", ds_name, "-n", namespace)["data"]["config.json"])
        selectors = config["configList"][0]["selectors"]
        assert selectors == {"vendors": ["15b3"], "deviceIDs": ["101b"]}
        assert f"rdma/{config['configList'][0]['resourceName']}" == "rdma/hca_shared_devices_a"
    finally:
        cluster.run("label", "node", "gpu-node-1", f"{label}-", check=False)


BAD_VALUES = [
    ("replicaCount=-1", "/replicaCount"),
    ("replicaCount=two", "/replicaCount"),
    ("logLevel=LOUD", "/logLevel"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("healthPort=80", "/healthPort"),
    ("watchNamespaces={Bad_NS}", "/watchNamespaces/0"),
    ("rbac.create=maybe", "/rbac/create"),
    ("leaderElection.enabled=1", "/leaderElection/enabled"),
    ("rdmaDevicePlugin.vendors={mellanox}", "/rdmaDevicePlugin/vendors/0"),
    ("rdmaDevicePlugin.rdmaHcaMax=0", "/rdmaDevicePlugin/rdmaHcaMax"),
    ("metrics.serviceMonitor.interval=often", "/metrics/serviceMonitor/interval"),
    ("replicaCunt=2", "replicaCunt"),
    ("admissionPolicy.enabled=yes", "/admissionPolicy/enabled"),
    ("admissionPolicy.privilegedEnginesLabel=bad label", "/admissionPolicy/privilegedEnginesLabel"),
    ("operatorPolicy.allowedImagePrefixes={a,}", "/operatorPolicy/allowedImagePrefixes/1"),
    ("admissionPolicy.maxEnginePriority=2000000000", "/admissionPolicy/maxEnginePriority"),
]


@pytest.mark.parametrize(("value", "path"), BAD_VALUES, ids=[v for v, _ in BAD_VALUES])
def test_bad_values_are_refused_and_install_nothing(
    cluster: Cluster, crd: str, namespace: str, value: str, path: str
) -> None:
    result = cluster.helm(
        "install", release(namespace), str(CHART), "-n", namespace, "--set", value, check=False
    )
    assert result.returncode != 0
    assert path in result.stderr, result.stderr
    assert cluster.helm("list", "-n", namespace, "-q").stdout.strip() == ""
    assert (
        cluster.get_json(
            "deployments,serviceaccounts", "-n", namespace, "-l", "app.kubernetes.io/name=dllm-operator"
        )["items"]
        == []
    )
