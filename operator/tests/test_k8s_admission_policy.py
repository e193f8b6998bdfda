"""Privileged engine settings need the namespace's opt-in (H7): the chart's ValidatingAdmissionPolicies
refuse them (and a capped PriorityClass, and an operator identity that mounts a token or borrows an
account) naming the field, admit unprivileged asks, and store nothing refused; without the chart's
policy the operator itself refuses the same settings."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dllm_cases import PRIVILEGED, ROOT, TOLERATE_CONTROL_PLANE, UNPRIVILEGED, load_cr, merged, minimal
from e2e.fixtures import Cluster, wait_until
from e2e.operator_process import OperatorProcess
from e2e.samples import cpu_sample_on_kwok
from k8s_dry_run import create

from dllm_operator.api import parse
from dllm_operator.render import auth, render_all

pytestmark = pytest.mark.k8s


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


def test_operator_identity_takes_over_nothing_and_widens_no_pod(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """NEW-6, as the operator's ServiceAccount: a patch that adds the label and an ownerRef to an object
    that was not the operator's is refused (the old object is judged too), and so are an init container
    that is privileged, an added capability other than IPC_LOCK, privilege escalation, uid 0, secret
    and projected volumes, a Secret read into env other than the resource's own keys and a listed hub
    token (or a whole one, envFrom), and Secrets other than an Opaque `<resource>-dllm-auth`."""
    docs = chart_policies(cluster, f"w{namespace[-8:]}", namespace)
    user = re.search(r"username == '([^']+)'", json.dumps(docs))
    assert user is not None
    body = merged(minimal("ops"), {"metadata": {"namespace": namespace, "uid": "u"}})
    cr = parse(body)
    sts = next(m for m in render_all(cr) if m["kind"] == "StatefulSet")
    engine = sts["spec"]["template"]["spec"]["containers"][0]

    def as_operator(*args: str, obj: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        text = json.dumps(obj) if obj is not None else None
        return cluster.run(
            f"--as={user[1]}", "--as-group=system:masters", *args, "--dry-run=server", "-n", namespace,
            input_text=text, check=False,
        )  # fmt: skip

    def pod_with(pod: dict[str, Any], container: dict[str, Any] | None = None) -> dict[str, Any]:
        spec = merged(sts["spec"]["template"]["spec"], pod)
        if container is not None:
            spec["containers"] = [merged(engine, container)]
        return merged(sts, {"spec": {"template": {"spec": spec}}})

    def with_volume(volume: dict[str, Any]) -> dict[str, Any]:
        return pod_with({"volumes": [*sts["spec"]["template"]["spec"]["volumes"], volume]})

    escalating = {"securityContext": {"allowPrivilegeEscalation": True}}

    def env_from_secret(secret: str) -> dict[str, Any]:
        ref = {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": secret, "key": "k"}}}
        return pod_with({}, {"env": [*engine["env"], ref]})

    refused = {
        "privileged init container": pod_with(
            {
                "initContainers": [
                    {"name": "init", "image": engine["image"], "securityContext": {"privileged": True}}
                ]
            }
        ),
        "SYS_ADMIN": pod_with({}, {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}),
        "escalation": pod_with({}, escalating),
        "uid 0": pod_with({"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}),
        "secret volume": with_volume({"name": "s", "secret": {"secretName": "payments-db"}}),
        "projected token": with_volume(
            {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
        ),
        "token Secret": merged(
            auth.new_secret(cr),
            {
                "type": "kubernetes.io/service-account-token",
                "metadata": {"annotations": {"kubernetes.io/service-account.name": "default"}},
            },
        ),
        "foreign Secret name": merged(auth.new_secret(cr), {"metadata": {"name": "payments-db"}}),
        "another Secret in env": env_from_secret("payments-db"),
        "another resource's keys in env": env_from_secret("other-dllm-auth"),
        "a whole Secret as env": pod_with({}, {"envFrom": [{"secretRef": {"name": "payments-db"}}]}),
    }
    allowed = {
        "the rendered StatefulSet": sts,
        "the auth Secret": auth.new_secret(cr),
        "IPC_LOCK for RDMA": pod_with({}, {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}),
        "a listed hub token Secret in env": env_from_secret("hf-token"),
    }
    bystander = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "dns-like"},
        "spec": {
            "selector": {"matchLabels": {"app": "dns-like"}},
            "template": {
                "metadata": {"labels": {"app": "dns-like"}},
                "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/coredns:v1"}]},
            },
        },
    }
    cluster.apply(bystander, "-n", namespace)
    takeover = {
        "metadata": {
            "labels": {"app.kubernetes.io/managed-by": "dllm-operator"},
            "ownerReferences": [
                {
                    "apiVersion": "disagg.dev/v1alpha1",
                    "kind": "DisaggregatedLLM",
                    "name": "made-up",
                    "uid": "x",
                    "controller": True,
                }
            ],
        },
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "evil.example/dns:1"}]}}},
    }
    patch = ("patch", "deployment", "dns-like", "--type=strategic", "-p", json.dumps(takeover))
    cluster.run("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump_all(docs))
    try:
        wait_until(lambda: as_operator(*patch).returncode != 0, 30, "the operator policies in force")
        assert "before and after the change" in as_operator(*patch).stderr
        assert as_operator("delete", "deployment", "dns-like").returncode != 0
        for what, obj in allowed.items():
            result = as_operator("create", "-f", "-", obj=obj)
            assert result.returncode == 0, f"{what}: {result.stderr}"
        for what, obj in refused.items():
            result = as_operator("create", "-f", "-", obj=obj)
            assert result.returncode != 0, f"{what} was admitted"
            assert "dllm-operator ServiceAccount" in result.stderr, f"{what}: {result.stderr}"
        deployment = cluster.get_json("deployment", "dns-like", "-n", namespace)
        assert (
            deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.k8s.io/coredns:v1"
        )
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


def test_nobody_but_the_operator_makes_or_rekeys_a_resources_auth_secret(
    cluster: Cluster, crd: str, namespace: str
) -> None:
    """NEW-10: the operator may create but never read Secrets, so it cannot tell its `<name>-dllm-auth`
    from one planted first under that name, whose keys the planter would know. The chart reserves the
    name: anyone else (a cluster admin included) is refused creating one, before or after the resource
    exists, and changing its keys; nothing is stored. The operator still makes it, others may
    still label or delete it (rotation), and Secrets with other names are nobody's business."""
    docs = chart_policies(cluster, f"s{namespace[-8:]}", namespace)
    user = re.search(r"username == '([^']+)'", json.dumps(docs))
    assert user is not None
    body = merged(minimal("keys"), {"metadata": {"namespace": namespace}})
    cluster.apply(body, "-n", namespace)  # a real owner: the garbage collector keeps what it controls
    uid = cluster.get_json("dllm", "keys", "-n", namespace)["metadata"]["uid"]
    cr = parse(merged(body, {"metadata": {"uid": uid}}))
    planted = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": auth.secret_name(cr)},
        "stringData": {"kv-token": "known", "api-key": "known"},
    }

    def create_secret(obj: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
        return cluster.run(
            "create", "-n", namespace, "-f", "-", *extra, input_text=json.dumps(obj), check=False
        )

    def edit(verb: str, *args: str) -> subprocess.CompletedProcess[str]:
        return cluster.run(verb, "secret", auth.secret_name(cr), *args, "-n", namespace, check=False)

    cluster.run("apply", "--server-side", "-f", "-", input_text=yaml.safe_dump_all(docs))
    try:
        wait_until(
            lambda: create_secret(planted, "--dry-run=server").returncode != 0, 30, "the policy in force"
        )
        for name in (auth.secret_name(cr), "keys-other-dllm-auth"):
            result = create_secret(merged(planted, {"metadata": {"name": name}}))
            assert result.returncode != 0, f"{name} was admitted"
            assert "reserved for the dllm-operator" in result.stderr, result.stderr
        assert cluster.get_json("secrets", "-n", namespace)["items"] == []
        assert create_secret(merged(planted, {"metadata": {"name": "keys-auth"}})).returncode == 0

        made = create_secret(auth.new_secret(cr), f"--as={user[1]}", "--as-group=system:masters")
        assert made.returncode == 0, made.stderr
        kept = cluster.get_json("secret", auth.secret_name(cr), "-n", namespace)["data"]
        for data in ({"stringData": {"kv-token": "known"}}, {"data": {"api-key": "a25vd24="}}):
            result = edit("patch", "-p", json.dumps(data))
            assert result.returncode != 0
            assert "reserved for the dllm-operator" in result.stderr, result.stderr
        assert cluster.get_json("secret", auth.secret_name(cr), "-n", namespace)["data"] == kept
        assert edit("label", "team=serving").returncode == 0
        assert edit("delete").returncode == 0
    finally:
        for doc in docs:
            cluster.run("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)
