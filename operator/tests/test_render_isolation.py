"""C2, H7, M4: isolation, authentication, non-root engines, the router's drain, and the operator's
refusal of privileged engines and of images outside its allowed registries."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from dllm_cases import PRIVILEGED, ROOT, UNPRIVILEGED, load_cr, merged, minimal
from rendered import UID, of_kind, rendered

from dllm_contract.router_defaults import DEFAULT_MAX_ANSWER_MB, DEFAULT_MAX_BODY_MB, DEFAULT_MEMORY_BUDGET_MB
from dllm_operator.api import SpecInvalid, parse
from dllm_operator.config import ConfigInvalid, OperatorConfig
from dllm_operator.render import render_all
from dllm_operator.render.ports import transfer_port_range, usable


def engine_pods(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        sts["metadata"]["name"].rsplit("-", 1)[1]: sts["spec"]["template"]["spec"]
        for sts in of_kind(manifests, "StatefulSet")
    }


def policy(manifests: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(m for m in of_kind(manifests, "NetworkPolicy") if m["metadata"]["name"] == name)


def matches(selector: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against one pod's labels."""
    if not selector.get("matchLabels", {}).items() <= pod_labels.items():
        return False
    return all(pod_labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_engines_accept_each_other_on_any_port_and_the_router_on_http_only() -> None:
    manifests = rendered(load_cr(ROOT / "crds/samples/cpu-tiny.yaml"))
    engines = policy(manifests, "tiny-cpu-engines")
    assert engines["metadata"]["ownerReferences"][0]["uid"] == UID
    pod_labels = {
        sts["metadata"]["name"]: sts["spec"]["template"]["metadata"]["labels"]
        for sts in of_kind(manifests, "StatefulSet")
    }
    router_labels = of_kind(manifests, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert all(matches(engines["spec"]["podSelector"], labels) for labels in pod_labels.values())
    assert not matches(engines["spec"]["podSelector"], router_labels)
    assert engines["spec"]["policyTypes"] == ["Ingress"]
    peers, router_rule, host = engines["spec"]["ingress"]
    assert host == {
        "from": [{"ipBlock": {"cidr": "10.250.0.1/32"}}],
        "ports": [{"port": "http", "protocol": "TCP"}],
    }
    assert "ports" not in peers  # any port: side channel, Mooncake, TCPStore
    assert all(matches(peers["from"][0]["podSelector"], labels) for labels in pod_labels.values())
    assert not matches(peers["from"][0]["podSelector"], {**router_labels, "app.kubernetes.io/instance": "x"})
    assert matches(router_rule["from"][0]["podSelector"], router_labels)
    assert router_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    other_cr = {**router_labels, "app.kubernetes.io/instance": "other"}
    assert not matches(router_rule["from"][0]["podSelector"], other_cr)
    router = policy(manifests, "tiny-cpu-router")
    assert matches(router["spec"]["podSelector"], router_labels)
    assert router["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]  # from anywhere


def test_network_policy_peers_and_the_mooncake_bootstrap_port() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    clients = {"podSelector": {"matchLabels": {"role": "client"}}}
    body = merged(
        minimal(),
        {
            "spec": {
                "kvTransfer": {"connector": "custom", "custom": {"connectorClass": "MooncakeConnector"}},
                "security": {"engineAllowedFrom": [prometheus], "routerAllowedFrom": [clients]},
            }
        },
    )
    manifests = rendered(body)
    ingress = policy(manifests, "minimal-engines")["spec"]["ingress"]
    assert ingress[1]["ports"] == [{"port": "http", "protocol": "TCP"}, {"port": 8998, "protocol": "TCP"}]
    assert ingress[2] == {"from": [prometheus], "ports": [{"port": "http", "protocol": "TCP"}]}
    assert policy(manifests, "minimal-router")["spec"]["ingress"][0]["from"] == [clients]


IN_CLUSTER = OperatorConfig(
    pod_namespace="dllm-system", pod_labels={"app.kubernetes.io/name": "dllm-operator"}
)
OPERATOR_PODS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dllm-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "dllm-operator"}},
}


def router_peers(body: dict[str, Any], config: OperatorConfig) -> list[dict[str, Any]] | None:
    manifests = render_all(parse(body), config)
    peers: list[dict[str, Any]] | None = policy(manifests, f"{body['metadata']['name']}-router")["spec"][
        "ingress"
    ][0].get("from")
    return peers


def test_a_router_closed_to_all_but_its_clients_admits_the_operator_pods_that_read_its_kv_check() -> None:
    clients = {"podSelector": {"matchLabels": {"role": "client"}}}
    body = merged(minimal(), {"spec": {"security": {"routerAllowedFrom": [clients]}}})
    assert router_peers(body, IN_CLUSTER) == [clients, OPERATOR_PODS]
    # Off-cluster, with the reading off, or where the router runs no check: only the clients.
    assert router_peers(body, OperatorConfig()) == [clients]
    assert router_peers(body, IN_CLUSTER.model_copy(update={"kv_check_poll_seconds": 0})) == [clients]
    custom = {"connector": "custom", "custom": {"connectorClass": "MooncakeConnector"}}
    assert router_peers(merged(body, {"spec": {"kvTransfer": custom}}), IN_CLUSTER) == [clients]
    # Open to all: nothing to add.
    assert router_peers(minimal(), IN_CLUSTER) is None


def test_the_engines_admit_the_operator_pods_on_http_only_while_its_autoscaler_reads_them() -> None:
    """Advisory autoscaling reads the engines' /metrics: their policy admits the operator's pods on the
    HTTP port then, and not otherwise (nor off-cluster, nor with the reading off)."""
    advisory = {"mode": "advisory", "decode": {"maxReplicas": 2, "target": {"kvCacheUsage": 0.7}}}
    body = merged(minimal(), {"spec": {"autoscaling": advisory}})
    http = [{"port": "http", "protocol": "TCP"}]

    def engine_ingress(spec: dict[str, Any], config: OperatorConfig) -> list[dict[str, Any]]:
        rules: list[dict[str, Any]] = policy(render_all(parse(spec), config), "minimal-engines")["spec"][
            "ingress"
        ]
        return rules

    assert {"from": [OPERATOR_PODS], "ports": http} in engine_ingress(body, IN_CLUSTER)
    for spec, config in (
        (minimal(), IN_CLUSTER),
        (body, OperatorConfig()),
        (body, IN_CLUSTER.model_copy(update={"autoscale_poll_seconds": 0})),
    ):
        assert all(OPERATOR_PODS not in rule.get("from", []) for rule in engine_ingress(spec, config))
    # a router closed to all but its clients admits the operator too (its TTFT and ITL histograms)
    clients = {"podSelector": {"matchLabels": {"role": "client"}}}
    closed = merged(body, {"spec": {"security": {"routerAllowedFrom": [clients]}}})
    assert router_peers(closed, IN_CLUSTER.model_copy(update={"kv_check_poll_seconds": 0})) == [
        clients,
        OPERATOR_PODS,
    ]


def test_without_a_router_the_engines_http_port_is_the_endpoint() -> None:
    manifests = rendered(merged(minimal(), {"spec": {"router": {"enabled": False}}}))
    assert [m["metadata"]["name"] for m in of_kind(manifests, "NetworkPolicy")] == ["minimal-engines"]
    assert policy(manifests, "minimal-engines")["spec"]["ingress"][1] == {
        "ports": [{"port": "http", "protocol": "TCP"}]
    }


def test_auth_secret_reaches_engines_and_router_by_reference_only() -> None:
    manifests = rendered(minimal())
    for pod in engine_pods(manifests).values():
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["DLLM_KV_AUTH_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "minimal-dllm-auth", "key": "kv-token"}
        }
        assert env["VLLM_API_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "minimal-dllm-auth", "key": "api-key"}
        }
        assert "value" not in env["VLLM_API_KEY"]
    router = of_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert router["env"] == [
        {
            "name": "DLLM_ENGINE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "minimal-dllm-auth", "key": "api-key"}},
        }
    ]
    assert of_kind(manifests, "Secret") == []  # random values: the controller creates it once


def test_security_opt_out_renders_no_policy_and_no_secret_refs() -> None:
    body = merged(minimal(), {"spec": {"security": {"networkPolicy": False, "authentication": False}}})
    manifests = rendered(body)
    assert of_kind(manifests, "NetworkPolicy") == []
    text = yaml.safe_dump_all(manifests)
    assert "secretKeyRef" not in text
    assert "DLLM_ENGINE_API_KEY" not in text


def test_transfer_ports_are_a_function_of_the_kv_port() -> None:
    assert transfer_port_range(50051) == (61128, 61255)  # the default port is ephemeral: a spare slot
    assert transfer_port_range(20000) == (20064, 20191)  # just above the side channel's 64 ports
    assert transfer_port_range(32700) == (32572, 32699)  # above would reach the ephemeral range
    assert transfer_port_range(65400) == (65272, 65399)  # above would pass 65535
    for port in range(1, 65536):  # Mooncake would silently ignore any other range
        low, high = transfer_port_range(port)
        assert high - low + 1 == 128, port
        assert usable(low, high), port
        assert high < port or low >= port + 64, port  # clear of the side channel's ports


def test_transfer_ports_and_side_channel_ports_reach_the_engine() -> None:
    body = merged(minimal(), {"spec": {"kvTransfer": {"port": 65000}, "decode": {"tensorParallelSize": 2}}})
    pods = engine_pods(rendered(body))
    decode = pods["decode"]["containers"][0]
    assert env_of_container(decode)["DLLM_KV_TRANSFER_PORTS"] == "65064-65191"
    assert [(p["name"], p["containerPort"]) for p in decode["ports"]] == [
        ("http", 8000),
        ("kv", 65000),
        ("kv-1", 65001),
    ]


def env_of_container(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_engines_run_as_the_images_non_root_user_without_rdma() -> None:
    for pod in engine_pods(rendered(minimal())).values():
        assert pod["securityContext"] == {
            "seccompProfile": {"type": "RuntimeDefault"},
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "fsGroup": 10001,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
        container = pod["containers"][0]["securityContext"]
        assert container["allowPrivilegeEscalation"] is False
        assert container["capabilities"] == {"drop": ["ALL"]}
        assert container["runAsNonRoot"] is True
        assert "hostNetwork" not in pod
        assert all("hostPath" not in volume for volume in pod["volumes"])


def test_rdma_capabilities_decide_root() -> None:
    with_lock = engine_pods(rendered(merged(minimal(), {"spec": {"rdma": {"enabled": True}}})))
    assert "runAsUser" not in with_lock["decode"]["securityContext"]  # IPC_LOCK reaches root only
    assert with_lock["decode"]["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    body = merged(minimal(), {"spec": {"rdma": {"enabled": True, "ipcLock": False}}})
    without = engine_pods(rendered(body))["decode"]
    assert without["securityContext"]["runAsUser"] == 10001
    assert without["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert without["containers"][0]["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"


def test_a_roles_security_context_sets_ids_and_seccomp_over_the_operators() -> None:
    context = {
        "runAsUser": 2000,
        "runAsGroup": 2001,
        "fsGroup": 3000,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/vllm.json"},
    }
    pods = engine_pods(rendered(merged(minimal(), {"spec": {"decode": {"securityContext": context}}})))
    assert pods["decode"]["securityContext"] == {
        **context,
        "runAsNonRoot": True,
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    assert pods["prefill"]["securityContext"]["runAsUser"] == 10001  # the other role keeps the default
    container = pods["decode"]["containers"][0]["securityContext"]
    assert container == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
    }
    # With an RDMA capability the engines stay root; groups and seccomp still apply.
    body = merged(
        minimal(), {"spec": {"rdma": {"enabled": True}, "prefill": {"securityContext": {"fsGroup": 7}}}}
    )
    root = engine_pods(rendered(body))["prefill"]["securityContext"]
    assert (root.get("runAsUser"), root["fsGroup"], root["seccompProfile"]) == (
        None,
        7,
        {"type": "RuntimeDefault"},
    )


def test_engines_mount_no_service_account_token_and_use_the_default_account() -> None:
    """Nothing in an engine or router pod calls the API: no token, and no account unless one is named."""
    manifests = rendered(minimal())
    for pod in [*engine_pods(manifests).values(), router_pod(manifests)]:
        assert pod["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod
    named = engine_pods(rendered(merged(minimal(), {"spec": {"serviceAccountName": "deployer"}})))
    assert named["decode"]["serviceAccountName"] == "deployer"
    assert named["decode"]["automountServiceAccountToken"] is False


def router_pod(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(of_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_router_grace_covers_its_drain_and_prestop() -> None:
    pod = router_pod(rendered(minimal()))
    container = pod["containers"][0]
    drain = int(flag(container["args"], "--drain-seconds"))
    prestop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert drain >= 600  # the router's request timeout: a stream started before SIGTERM can finish
    assert pod["terminationGracePeriodSeconds"] >= drain + prestop + 5
    short = router_pod(
        rendered(merged(minimal(), {"spec": {"router": {"terminationGracePeriodSeconds": 15}}}))
    )
    assert (
        short["terminationGracePeriodSeconds"],
        flag(short["containers"][0]["args"], "--drain-seconds"),
    ) == (
        15,
        "0",
    )


@pytest.mark.parametrize("grace", [120, 30, 10])
def test_an_engine_stopped_drains_in_flight_requests_after_sigterm_as_long_as_its_prestop(grace: int) -> None:
    """vLLM aborts what is in flight at SIGTERM unless --shutdown-timeout is set: a request that reached
    the engine after the preStop drain's last idle reading must get the same budget, within the grace
    period (10 s of which stay for vLLM's teardown; none left: abort, as the user asked)."""
    cr = merged(
        minimal(),
        {"spec": {role: {"terminationGracePeriodSeconds": grace} for role in ("prefill", "decode")}},
    )
    for name, pod in engine_pods(render_all(parse(cr), OperatorConfig())).items():
        container = pod["containers"][0]
        prestop = container["lifecycle"]["preStop"]["exec"]["command"]
        budget = grace - 10
        assert (flag(prestop, "--timeout"), flag(container["args"], "--shutdown-timeout")) == (
            str(budget),
            str(budget),
        ), name
        assert pod["terminationGracePeriodSeconds"] == grace


@pytest.mark.parametrize(
    ("limits", "body_mb", "budget_mb", "answer_mb"),
    [
        ({"memory": "1Gi"}, "8", "256", "64"),
        ({"memory": "512Mi"}, "4", "128", "32"),
        ({"memory": "64Mi"}, "1", "16", "4"),
        ({"memory": "8Mi"}, "1", "2", "1"),
        ({"memory": "64Gi"}, "64", "16384", "4096"),
        ({"memory": "1G"}, "7", "238", "59"),  # 10^9 bytes
        ({}, "8", "256", "64"),
    ],
)
def test_router_body_limit_and_memory_budget_follow_its_memory_limit(
    limits: dict[str, str], body_mb: str, budget_mb: str, answer_mb: str
) -> None:
    """H2 and NEW-1: the body limit, the memory budget (bodies and answers across requests) and one
    request's answer cap are fractions of the router's memory limit; with none, the router's defaults."""
    resources = {"requests": {"memory": "8Mi"}, "limits": limits}
    pod = router_pod(rendered(merged(minimal(), {"spec": {"router": {"resources": resources}}})))
    args = pod["containers"][0]["args"]
    assert flag(args, "--max-body-mb") == body_mb
    assert flag(args, "--memory-budget-mb") == budget_mb
    assert flag(args, "--max-answer-mb") == answer_mb


def test_router_defaults_match_what_the_operator_renders_for_the_default_memory_limit() -> None:
    """The router's own defaults are what the operator renders for its default 1 GiB limit, so a
    router started by hand is sized as a rendered one."""
    args = router_pod(rendered(minimal()))["containers"][0]["args"]
    assert flag(args, "--memory-budget-mb") == str(DEFAULT_MEMORY_BUDGET_MB)
    assert flag(args, "--max-answer-mb") == str(DEFAULT_MAX_ANSWER_MB)
    assert flag(args, "--max-body-mb") == str(DEFAULT_MAX_BODY_MB)


@pytest.mark.parametrize(("case", "patch", "path"), PRIVILEGED, ids=[c[0] for c in PRIVILEGED])
def test_operator_refuses_privileged_engines_when_configured(
    case: str, patch: dict[str, Any], path: str
) -> None:
    body = merged(merged(minimal(), {"metadata": {"namespace": "serving", "uid": UID}}), {"spec": patch})
    cr = parse(body)
    assert render_all(cr)  # allowed by default: the chart's admission policy decides per namespace
    with pytest.raises(SpecInvalid) as refused:
        render_all(cr, OperatorConfig(allow_privileged_engines=False))
    assert path in [error.path for error in refused.value.errors], case


@pytest.mark.parametrize(("case", "patch"), UNPRIVILEGED, ids=[c[0] for c in UNPRIVILEGED])
def test_operator_that_refuses_privileged_engines_still_renders_unprivileged_asks(
    case: str, patch: dict[str, Any]
) -> None:
    body = merged(merged(minimal(), {"metadata": {"namespace": "serving", "uid": UID}}), {"spec": patch})
    assert render_all(parse(body), OperatorConfig(allow_privileged_engines=False)), case


def test_hub_token_secret_stays_allowed_and_images_can_be_pinned_to_a_registry() -> None:
    hub = {
        "huggingFace": {
            "tokenSecretRef": {"name": "hf-token", "key": "token"},
            "cacheVolumeClaim": "hf-cache",
        }
    }
    env = [{"name": "HF_TOKEN_COPY", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    body = merged(minimal(), {"spec": {"model": {"name": "m", "source": hub}, "decode": {"env": env}}})
    assert render_all(parse(body), OperatorConfig(allow_privileged_engines=False))
    pinned = OperatorConfig(allowed_image_prefixes=("registry.example/",))
    assert render_all(parse(merged(minimal(), {"spec": {"image": "registry.example/vllm:1"}})), pinned)
    with pytest.raises(SpecInvalid, match=r"spec.router.image: evil.example/r:1"):
        render_all(parse(merged(minimal(), {"spec": {"router": {"image": "evil.example/r:1"}}})), pinned)


def test_the_lists_of_secrets_and_claims_a_resource_may_name_come_from_the_environment() -> None:
    config = OperatorConfig.from_env(
        {
            "DLLM_ALLOW_PRIVILEGED_ENGINES": "false",
            "DLLM_HUB_TOKEN_SECRETS": "team-a-hub",
            "DLLM_MODEL_VOLUME_CLAIMS": "team-a-models,team-a-cache",
        }
    )
    token = {
        "huggingFace": {
            "tokenSecretRef": {"name": "team-a-hub", "key": "t"},
            "cacheVolumeClaim": "team-a-cache",
        }
    }
    assert render_all(parse(merged(minimal(), {"spec": {"model": {"name": "m", "source": token}}})), config)
    default_name = {"huggingFace": {"tokenSecretRef": {"name": "hf-token", "key": "t"}}}
    with pytest.raises(
        SpecInvalid, match=r"hf-token: not one of the names .*DLLM_HUB_TOKEN_SECRETS: team-a-hub"
    ):
        render_all(
            parse(merged(minimal(), {"spec": {"model": {"name": "m", "source": default_name}}})), config
        )


def test_the_operators_hub_mirror_reaches_both_engines() -> None:
    config = OperatorConfig.from_env({"DLLM_HF_ENDPOINT": "https://hub-mirror.internal"})
    for child in render_all(parse(minimal()), config):
        if child["kind"] == "StatefulSet":
            env = child["spec"]["template"]["spec"]["containers"][0]["env"]
            assert {"name": "HF_ENDPOINT", "value": "https://hub-mirror.internal"} in env


def test_operator_flags_from_the_environment() -> None:
    config = OperatorConfig.from_env(
        {"DLLM_ALLOW_PRIVILEGED_ENGINES": "false", "DLLM_ALLOWED_IMAGE_PREFIXES": "a.example/, b.example/"}
    )
    assert (config.allow_privileged_engines, config.allowed_image_prefixes) == (
        False,
        ("a.example/", "b.example/"),
    )
    assert OperatorConfig.from_env({}).allow_privileged_engines is True
    with pytest.raises(ConfigInvalid, match="DLLM_ALLOW_PRIVILEGED_ENGINES: 'no' is not true or false"):
        OperatorConfig.from_env({"DLLM_ALLOW_PRIVILEGED_ENGINES": "no"})
