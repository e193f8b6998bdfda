"""The real API server admits what the model admits and refuses what it refuses, naming the field."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dllm_cases import (
    INVALID,
    PRIVILEGED,
    ROOT,
    SAMPLES,
    TOLERATE_CONTROL_PLANE,
    UNPRIVILEGED,
    invalid_body,
    load_cr,
    merged,
    minimal,
)
from e2e.fixtures import Cluster, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import cpu_sample_on_kwok

from dllm_operator.api import parse
from dllm_operator.render import render_all

pytestmark = pytest.mark.k8s


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_every_sample_is_admitted(cluster: Cluster, crd: str, namespace: str, path: Path) -> None:
    cluster.run("apply", "--server-side", "-n", namespace, "-f", "-", input_text=json.dumps(load_cr(path)))


def test_minimal_resource_is_admitted_and_defaulted_like_the_model(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(minimal()))
    stored = cluster.get_json("dllm", "minimal", "-n", namespace)
    # The API server's defaults and the model's defaults are the same values.
    assert parse(stored).spec == parse(minimal()).spec
    assert stored["spec"]["kvTransfer"]["port"] == 50051
    assert stored["spec"]["decode"]["enableChunkedPrefill"] is False


@pytest.mark.parametrize(("case", "patch", "path"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_resource_is_refused_naming_the_field(
    cluster: Cluster, crd: str, namespace: str, case: str, patch: dict[str, object], path: str
) -> None:
    body = invalid_body(patch, "bad")
    result = cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(body), check=False)
    assert result.returncode != 0, f"{case} was admitted"
    assert "no matches for kind" not in result.stderr
    # The whole path, not a prefix of a longer one (spec.model must not pass for spec.model.name).
    whole = rf"(?<![\w.\[]){re.escape(path)}(?![\w\[]|\.\w)"
    assert re.search(whole, result.stderr), f"{case}: {path} not named in: {result.stderr}"
    name = body["metadata"]["name"]
    assert not cluster.exists("dllm", name, "-n", namespace)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_rendered_children_pass_server_dry_run(
    cluster: Cluster, crd: str, namespace: str, path: Path
) -> None:
    body = load_cr(path)
    body["metadata"] |= {"namespace": namespace, "uid": "00000000-0000-0000-0000-000000000001"}
    manifests = render_all(parse(body))
    text = yaml.safe_dump_all(manifests)
    result = cluster.run(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager=dllm-operator",
        "-n",
        namespace,
        "-f",
        "-",
        input_text=text,
    )
    assert result.stdout.count("(server dry run)") == len(manifests)


def test_kubectl_explain_reads_well(cluster: Cluster, crd: str) -> None:
    text = cluster.run("explain", "dllm.spec.kvTransfer").stdout
    assert "How KV cache moves from prefill to decode" in text
    for field in ("connector", "compression", "bufferSizeGB", "timeoutMs", "async", "loadFailurePolicy"):
        assert f"  {field}\t" in text or f"  {field} " in text


def test_printer_columns(cluster: Cluster, crd: str, namespace: str) -> None:
    cluster.run("create", "-n", namespace, "-f", "-", input_text=json.dumps(minimal("cols")))
    header = cluster.run("get", "dllm", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PREFILL", "DECODE", "READY", "CONNECTOR", "AGE"]


# ---- H7: the chart's admission policy and Pod Security -------------------------------------------

CHART = ROOT / "charts" / "dllm-operator"
OPT_IN = "dllm.dev/allow-privileged-engines"
HUB = {"huggingFace": {"tokenSecretRef": {"name": "hf-token", "key": "token"}}}


def chart_policies(cluster: Cluster, release: str, namespace: str, *values: str) -> list[dict[str, Any]]:
    """The chart's admission policies, their bindings confined to `namespace` (tests run side by side)."""
    sets = [item for value in values for item in ("--set", value)]
    text = cluster.helm(
        "template",
        release,
        str(CHART),
        "-n",
        namespace,
        "--show-only",
        "templates/admission-policy.yaml",
        *sets,
    ).stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            selector = doc["spec"].setdefault("matchResources", {}).setdefault("namespaceSelector", {})
            expressions = selector.setdefault("matchExpressions", [])
            expressions.append(
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [namespace]}
            )
    return docs


@pytest.fixture
def engine_policy(cluster: Cluster, crd: str, namespace: str) -> Iterator[str]:
    release = f"p{namespace[-8:]}"
    docs = chart_policies(cluster, release, namespace, "admissionPolicy.limitOperator=false")
    cluster.run("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump_all(docs))
    probe = json.dumps(merged(minimal("probe"), {"spec": PRIVILEGED[0][1]}))

    def refused() -> bool:
        result = cluster.run(
            "create", "--dry-run=server", "-n", namespace, "-f", "-", input_text=probe, check=False
        )
        return result.returncode != 0

    wait_until(refused, 30, "the admission policy to take effect")
    yield release
    for doc in docs:
        cluster.run("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)


def create(cluster: Cluster, namespace: str, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    text = json.dumps(body)
    return cluster.run("create", "--dry-run=server", "-n", namespace, "-f", "-", input_text=text, check=False)


def test_privileged_engine_settings_need_the_namespace_opt_in(
    cluster: Cluster, namespace: str, engine_policy: str
) -> None:
    bodies = {case: merged(minimal(case), {"spec": patch}) for case, patch, _ in PRIVILEGED}
    for case, _, path in PRIVILEGED:
        result = create(cluster, namespace, bodies[case])
        assert result.returncode != 0, f"{case} was admitted in an unlabelled namespace"
        assert path.split("[")[0] in result.stderr, f"{case}: {result.stderr}"
        assert OPT_IN in result.stderr, f"{case}: {result.stderr}"
    hub_ref = {"name": "HF_COPY", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    allowed = merged(
        minimal("hub"), {"spec": {"model": {"name": "m", "source": HUB}, "decode": {"env": [hub_ref]}}}
    )
    assert create(cluster, namespace, allowed).returncode == 0  # the model's own hub token Secret
    assert create(cluster, namespace, load_cr(ROOT / "crds/samples/cpu-tiny.yaml")).returncode == 0
    cluster.run("label", "namespace", namespace, f"{OPT_IN}=true")

    def all_admitted() -> list[str]:
        return [case for case, body in bodies.items() if create(cluster, namespace, body).returncode != 0]

    wait_until(lambda: not all_admitted(), 30, "every privileged ask admitted once the namespace opts in")


def test_high_priority_classes_need_the_opt_in_when_the_chart_caps_them(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """admissionPolicy.maxEnginePriority: a class above it is refused naming the role's field and the
    class's value, one at or below it is admitted, and so is any class once the namespace opts in."""
    release = f"q{namespace[-8:]}"
    docs = chart_policies(
        cluster,
        release,
        namespace,
        "admissionPolicy.limitOperator=false",
        "admissionPolicy.maxEnginePriority=1000",
    )
    classes = {f"{release}-high": 1001, f"{release}-low": 1000}
    for name, value in classes.items():
        cluster.apply(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": name},
                "value": value,
            }
        )
    cluster.run("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump_all(docs))
    high = merged(minimal("high"), {"spec": {"decode": {"priorityClassName": f"{release}-high"}}})
    low = merged(minimal("low"), {"spec": {"prefill": {"priorityClassName": f"{release}-low"}}})
    try:
        wait_until(
            lambda: create(cluster, namespace, high).returncode != 0, 30, "the priority policy to take effect"
        )
        refusal = create(cluster, namespace, high).stderr
        assert f"spec.decode.priorityClassName: {release}-high (value 1001) is above 1000" in refusal
        assert OPT_IN in refusal
        assert create(cluster, namespace, low).returncode == 0
        cluster.run("label", "namespace", namespace, f"{OPT_IN}=true")
        wait_until(lambda: create(cluster, namespace, high).returncode == 0, 30, "the opt-in to take effect")
    finally:
        for doc in docs:
            cluster.run("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)
        for name in classes:
            cluster.run("delete", "priorityclass", name, "--ignore-not-found", check=False)


def test_operator_identity_mounts_no_token_and_borrows_no_account(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """admissionPolicy.limitOperator: whatever its RBAC allows, the operator's ServiceAccount writes no
    workload that mounts a token, and none with another account, a system- class or the control-plane
    taint unless the namespace opted in (so a taken-over operator cannot do what a CR may not ask)."""
    docs = chart_policies(cluster, f"o{namespace[-8:]}", namespace)
    user = re.search(r"username == '([^']+)'", json.dumps(docs))
    assert user is not None
    body = merged(minimal("ops"), {"metadata": {"namespace": namespace, "uid": "u"}})
    sts = next(m for m in render_all(parse(body)) if m["kind"] == "StatefulSet")

    def as_operator(pod: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        obj = merged(sts, {"spec": {"template": {"spec": pod}}})
        return cluster.run(
            f"--as={user[1]}", "--as-group=system:masters", "create", "--dry-run=server", "-n", namespace,
            "-f", "-", input_text=json.dumps(obj), check=False,
        )  # fmt: skip

    token = {"automountServiceAccountToken": True}
    gated: dict[str, dict[str, Any]] = {
        "account": {"serviceAccountName": "deployer"},
        "priority": {"priorityClassName": "system-node-critical"},
        "toleration": {"tolerations": TOLERATE_CONTROL_PLANE},
    }
    cluster.run("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump_all(docs))
    try:
        wait_until(lambda: as_operator(token).returncode != 0, 30, "the operator policies in force")
        assert "automountServiceAccountToken: false" in as_operator(token).stderr
        assert as_operator({}).returncode == 0, as_operator({}).stderr  # what the operator renders
        for what, pod in gated.items():
            result = as_operator(pod)
            assert result.returncode != 0, f"{what} was admitted"
            assert OPT_IN in result.stderr, result.stderr
        cluster.run("label", "namespace", namespace, f"{OPT_IN}=true")
        wait_until(
            lambda: all(as_operator(pod).returncode == 0 for pod in gated.values()), 30, "the opt-in in force"
        )
        assert as_operator(token).returncode != 0  # a token never
    finally:
        for doc in docs:
            cluster.run("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)


def test_unprivileged_asks_need_no_opt_in(cluster: Cluster, namespace: str, engine_policy: str) -> None:
    """The namespace's default ServiceAccount, a user PriorityClass, affinity away from control-plane
    nodes, a pull Secret and a bounded securityContext pass the policy in an unlabelled namespace."""
    for case, patch in UNPRIVILEGED:
        result = create(cluster, namespace, merged(minimal(case), {"spec": patch}))
        assert result.returncode == 0, f"{case}: {result.stderr}"


def test_a_refused_resource_is_not_stored(cluster: Cluster, namespace: str, engine_policy: str) -> None:
    for case, patch, path in PRIVILEGED:
        body = json.dumps(merged(minimal(case), {"spec": patch}))
        result = cluster.run("create", "-n", namespace, "-f", "-", input_text=body, check=False)
        assert result.returncode != 0, case
        assert path.split("[")[0] in result.stderr, f"{case}: {result.stderr}"
    assert cluster.get_json("dllm", "-n", namespace)["items"] == []


def test_operator_policy_refuses_naming_the_fields_and_creates_nothing(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    """Without the chart's policy, an operator run with DLLM_ALLOW_PRIVILEGED_ENGINES=false reports the
    resource invalid, naming each refused field, and makes none of its children; an unprivileged
    resource beside it is served."""
    env = {"DLLM_ALLOW_PRIVILEGED_ENGINES": "false"}
    log = tmp_path / "operator.log"
    operator = OperatorProcess(cluster.kubeconfig, [namespace], log, namespace, env=env).start()
    privileged = {
        "serviceAccountName": "deployer",
        "prefill": {"priorityClassName": "system-cluster-critical"},
        "router": {"tolerations": TOLERATE_CONTROL_PLANE},
    }
    try:
        cluster.apply(
            merged(cpu_sample_on_kwok(), {"metadata": {"name": "bad"}, "spec": privileged}), "-n", namespace
        )
        cluster.apply(cpu_sample_on_kwok(), "-n", namespace)

        def ready_condition() -> dict[str, Any] | None:
            conditions = (
                cluster.get_json("dllm", "bad", "-n", namespace).get("status", {}).get("conditions", [])
            )
            return next((c for c in conditions if c["type"] == "Ready"), None)

        ready = wait_until(ready_condition, 60, f"the invalid resource's status ({log})")
        assert ready["reason"] == "InvalidSpec"
        for field in (
            "spec.serviceAccountName",
            "spec.prefill.priorityClassName",
            "spec.router.tolerations[0].key",
        ):
            assert field in ready["message"], ready["message"]

        def names(kind: str) -> set[str]:
            return {i["metadata"]["name"] for i in cluster.get_json(kind, "-n", namespace)["items"]}

        wait_until(
            lambda: "tiny-cpu-decode" in names("statefulsets"), 60, f"the valid resource's children ({log})"
        )
        for kind in ("statefulsets", "deployments", "services", "networkpolicies", "secrets"):
            assert not {n for n in names(kind) if n.startswith("bad-")}, kind
    finally:
        operator.stop()


def test_security_context_overrides_meet_pod_security_restricted(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """A role's runAsUser, runAsGroup, fsGroup and Localhost seccomp profile keep its pods within
    "restricted"; the same pod as root (what the CR cannot ask) is refused."""
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    patch = dict(UNPRIVILEGED)["security-context"]
    body = merged(merged(minimal("ids"), {"metadata": {"namespace": namespace, "uid": "u"}}), {"spec": patch})
    sts = next(
        m
        for m in render_all(parse(body))
        if m["metadata"]["name"] == "ids-decode" and m["kind"] == "StatefulSet"
    )
    template = sts["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "ids"},
        "spec": template["spec"],
    }
    result = create(cluster, namespace, pod)
    assert result.returncode == 0, result.stderr
    as_root = merged(pod, {"spec": {"securityContext": {"runAsUser": 0}}})
    assert "runAsUser=0" in create(cluster, namespace, as_root).stderr


def test_engine_pods_meet_pod_security_restricted(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    """The operator reconciles the CPU sample in a namespace enforcing "restricted": the StatefulSets'
    and the Deployment's controllers create every pod (no FailedCreate), beside the resource's
    NetworkPolicies and auth Secret."""
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    operator = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace).start()
    try:
        cluster.apply(cpu_sample_on_kwok(), "-n", namespace)

        def pods() -> set[str]:
            selector = "app.kubernetes.io/instance=tiny-cpu"
            items = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
            return {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in items}

        def failed_creates() -> list[str]:
            events = cluster.get_json("events", "-n", namespace)["items"]
            return [e["message"] for e in events if e["reason"] == "FailedCreate"]

        wait_until(
            lambda: pods() == {"prefill", "decode", "router"} or failed_creates(),
            90,
            f"the pods (operator log: {operator.log_path})",
        )
        assert failed_creates() == []
        policies = cluster.get_json("networkpolicies", "-n", namespace)["items"]
        assert sorted(p["metadata"]["name"] for p in policies) == ["tiny-cpu-engines", "tiny-cpu-router"]
        assert cluster.exists("secret", "tiny-cpu-auth", "-n", namespace)
    finally:
        operator.stop()


def test_rdma_device_plugin_engines_meet_baseline_without_ipc_lock(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """IPC_LOCK is outside Pod Security "baseline": with rdma.ipcLock false (memlock from the runtime) the
    engines run as the non-root user and a baseline namespace admits them; with it, it refuses them."""
    cluster.run("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    for ipc_lock, admitted in ((False, True), (True, False)):
        body = merged(minimal("rdma"), {"metadata": {"namespace": namespace, "uid": "u"}})
        body = merged(body, {"spec": {"rdma": {"enabled": True, "ipcLock": ipc_lock}}})
        sts = next(m for m in render_all(parse(body)) if m["kind"] == "StatefulSet")
        template = sts["spec"]["template"]
        metadata = {**template["metadata"], "name": "rdma-engine"}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
        result = create(cluster, namespace, pod)
        assert (result.returncode == 0) is admitted, (ipc_lock, result.stderr)
        if not admitted:
            assert "IPC_LOCK" in result.stderr


def test_turning_isolation_and_authentication_off_removes_them(
    cluster: Cluster, crd: str, namespace: str, tmp_path: Path
) -> None:
    """spec.security opts out: the operator deletes the NetworkPolicies it made, and the pods lose their
    secret references (the Secret itself stays until the resource goes; the operator cannot delete it)."""
    operator = OperatorProcess(cluster.kubeconfig, [namespace], tmp_path / "operator.log", namespace).start()
    try:
        cluster.apply(cpu_sample_on_kwok(), "-n", namespace)

        def policies() -> list[str]:
            items = cluster.get_json("networkpolicies", "-n", namespace)["items"]
            return sorted(p["metadata"]["name"] for p in items)

        def secret_refs() -> set[str]:
            sts = cluster.get_json("statefulset", "tiny-cpu-decode", "-n", namespace, "--ignore-not-found")
            containers = sts.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])
            return {
                e["name"] for e in containers[0].get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
            }

        wait_until(lambda: policies() == ["tiny-cpu-engines", "tiny-cpu-router"], 60, "the NetworkPolicies")
        wait_until(lambda: secret_refs() == {"DLLM_KV_AUTH_TOKEN", "VLLM_API_KEY"}, 60, "the secret refs")
        off = {"spec": {"security": {"networkPolicy": False, "authentication": False}}}
        cluster.run("patch", "dllm", "tiny-cpu", "-n", namespace, "--type=merge", "-p", json.dumps(off))
        wait_until(lambda: policies() == [], 60, f"the NetworkPolicies pruned ({operator.log_path})")
        wait_until(lambda: secret_refs() == set(), 60, "no secret refs")
    finally:
        operator.stop()
