"""Rendering: reviewable snapshots of every sample, plus the invariants a user relies on."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dllm_cases import PRIVILEGED, ROOT, SAMPLES, UNPRIVILEGED, load_cr, merged, minimal

from dllm_contract.kvconfig import CONTRACT_ENV_NAMES, DOWNWARD_API_ENV
from dllm_operator.api import SpecInvalid, parse
from dllm_operator.config import ConfigInvalid, OperatorConfig
from dllm_operator.render import HASH_ANNOTATION, render_all
from dllm_operator.render.compose import render_compose
from dllm_operator.render.ports import transfer_port_range, usable

SNAPSHOTS = Path(__file__).parent / "snapshots"
UID = "11111111-2222-3333-4444-555555555555"
ENV_BY_ROLE = {
    "prefill": set(CONTRACT_ENV_NAMES) - {"VLLM_KV_PREFILL_WAIT_MS"},
    "decode": set(CONTRACT_ENV_NAMES) - {"VLLM_KV_DECODE_IP", "VLLM_KV_DECODE_PORT", "VLLM_KV_HOLD_SECONDS"},
}
OPTIONAL_ENV = {
    "MOONCAKE_RDMA_DEVICE",
    "MC_GID_INDEX",
    "VLLM_KV_CONNECTOR_CLASS",
    "VLLM_KV_CONNECTOR_MODULE_PATH",
    "VLLM_KV_CONNECTOR_EXTRA_CONFIG",
}


def rendered(body: dict[str, Any]) -> list[dict[str, Any]]:
    body = merged(body, {"metadata": {"namespace": "serving", "uid": UID}})
    return render_all(parse(body))


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def env_of(statefulset: dict[str, Any]) -> dict[str, Any]:
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_snapshot(path: Path) -> None:
    text = yaml.safe_dump_all(rendered(load_cr(path)), sort_keys=False, width=120)
    snapshot = SNAPSHOTS / f"{path.stem}.yaml"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snapshot.write_text(text)
    assert snapshot.exists(), f"{snapshot} is missing: review the render, then UPDATE_SNAPSHOTS=1"
    assert text == snapshot.read_text(), f"{snapshot} differs: review, then UPDATE_SNAPSHOTS=1"


@pytest.mark.parametrize("path", [*SAMPLES, None], ids=lambda p: p.stem if p else "minimal")
def test_invariants(path: Path | None) -> None:
    body = load_cr(path) if path else minimal()
    manifests = rendered(body)
    user_labels = set()
    for role in ("prefill", "decode"):
        user_labels |= set(body["spec"].get(role, {}).get("podLabels", {}))
    for m in manifests:
        assert len(m["metadata"]["name"]) <= 63
        assert m["metadata"]["ownerReferences"][0]["uid"] == UID
        assert HASH_ANNOTATION in m["metadata"]["annotations"]
        selector = m["spec"].get("selector", {})
        selector = selector.get("matchLabels", selector)
        if m["kind"] in ("StatefulSet", "Deployment"):
            pod_labels = m["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= pod_labels.items()
            assert not user_labels & set(selector)
            assert len(m["metadata"]["name"]) <= 52
            for container in m["spec"]["template"]["spec"]["containers"]:
                assert container["securityContext"].get("privileged") in (None, False)
    for sts in of_kind(manifests, "StatefulSet"):
        role = sts["metadata"]["name"].rsplit("-", 1)[1]
        present = set(env_of(sts))
        assert ENV_BY_ROLE[role] - OPTIONAL_ENV <= present


def test_downward_api_fills_host_ip_and_engine_id() -> None:
    for sts in of_kind(rendered(minimal()), "StatefulSet"):
        env = env_of(sts)
        for name, path in DOWNWARD_API_ENV.items():
            assert env[name] == {"fieldRef": {"fieldPath": path}}


def test_seed_resources_security_and_network() -> None:
    manifests = rendered(load_cr(ROOT / "crds/samples/seed-llama2-70b.yaml"))
    prefill = next(
        m for m in of_kind(manifests, "StatefulSet") if m["metadata"]["name"] == "llama2-70b-prefill"
    )
    pod = prefill["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
    assert container["resources"]["requests"]["memory"] == "4096Mi"  # the 4 GB pinned buffer
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    assert "hostNetwork" not in pod
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert prefill["spec"]["podManagementPolicy"] == "Parallel"
    hf = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert hf["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert "--tensor-parallel-size" in container["args"]


def test_host_devices_get_narrow_capabilities_not_privileged() -> None:
    body = merged(
        minimal(),
        {
            "spec": {
                "rdma": {
                    "enabled": True,
                    "mode": "hostDevices",
                    "hostNetwork": True,
                    "networks": ["roce-net"],
                }
            }
        },
    )
    for sts in of_kind(rendered(body), "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        security = pod["containers"][0]["securityContext"]
        assert security["privileged"] is False
        assert security["capabilities"]["add"] == ["IPC_LOCK", "SYS_RESOURCE"]
        assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
        assert sts["spec"]["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-net"
        assert {"name": "infiniband", "mountPath": "/dev/infiniband"} in pod["containers"][0]["volumeMounts"]


def test_unset_replicas_are_not_written() -> None:
    for sts in of_kind(rendered(load_cr(ROOT / "crds/samples/autoscaled.yaml")), "StatefulSet"):
        assert "replicas" not in sts["spec"]


def test_pdb_only_with_more_than_one_replica() -> None:
    manifests = rendered(load_cr(ROOT / "crds/samples/tcp-no-rdma.yaml"))
    assert {m["metadata"]["name"] for m in of_kind(manifests, "PodDisruptionBudget")} == {
        "llama3-8b-tcp-prefill",
        "llama3-8b-tcp-decode",
    }
    assert of_kind(rendered(minimal()), "PodDisruptionBudget") == []


def test_router_disabled_renders_no_router() -> None:
    manifests = rendered(merged(minimal(), {"spec": {"router": {"enabled": False}}}))
    assert [m["metadata"]["name"] for m in manifests if "router" in m["metadata"]["name"]] == []


def test_router_lands_where_its_spec_says() -> None:
    """The router's own nodeSelector and tolerations (e.g. the local cluster's tainted real node)."""
    placement = {
        "nodeSelector": {"dllm.dev/node": "real"},
        "tolerations": [{"key": "dllm.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}],
    }
    manifests = rendered(merged(minimal(), {"spec": {"router": placement}}))
    pod = of_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == placement["nodeSelector"]
    assert pod["tolerations"] == placement["tolerations"]
    unplaced = of_kind(rendered(minimal()), "Deployment")[0]["spec"]["template"]["spec"]
    assert "nodeSelector" not in unplaced
    assert "tolerations" not in unplaced


def test_user_labels_never_reach_selectors() -> None:
    body = merged(
        minimal(), {"spec": {"decode": {"podLabels": {"team": "a", "app.kubernetes.io/name": "x"}}}}
    )
    decode = next(
        m for m in of_kind(rendered(body), "StatefulSet") if m["metadata"]["name"].endswith("decode")
    )
    assert "team" not in decode["spec"]["selector"]["matchLabels"]
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "a"
    assert labels["app.kubernetes.io/name"] == "dllm"  # ours win over a user's clash


# The KV variables of the seed design's docker-compose, per service, as its compose block states them.
# Kept here so that the render is checked against them in any checkout (CI's clone has no seed beside
# it); where the seed document is there, the copy is checked against it (test_the_kept_seed_...).
SEED_COMPOSE_KV = {
    "prefill-server": {
        "VLLM_KV_CONNECTOR": "mooncake",
        "VLLM_KV_ROLE": "prefill",
        "VLLM_KV_DECODE_IP": "decode-server",
        "VLLM_KV_DECODE_PORT": "50051",
    },
    "decode-server": {
        "VLLM_KV_CONNECTOR": "mooncake",
        "VLLM_KV_ROLE": "decode",
        "VLLM_KV_LISTEN_PORT": "50051",
    },
    "mooncake-transfer": {"MOONCAKE_RDMA_DEVICE": "mlx5_0", "MOONCAKE_BUFFER_SIZE": "16G"},
}
SEED_DIR = ROOT.parent / "shared" / "seed"  # the team's seed sits beside the checkout, not in it
SEED_DOCUMENTS = sorted(SEED_DIR.glob("*.txt"))


def compose_kv_vars(text: str) -> dict[str, dict[str, str]]:
    """The seed's docker-compose: KV variables per service (its indentation is lost in the seed file)."""
    services: dict[str, dict[str, str]] = {}
    current = ""
    for line in text.splitlines():
        if re.match(r"^[a-z-]+-server:$|^mooncake-transfer:$", line.strip()):
            current = line.strip().rstrip(":")
            services[current] = {}
        match = re.match(r"^- ((?:VLLM_KV|MOONCAKE)_[A-Z_]+)=(.*)$", line.strip())
        if current and match:
            services[current][match.group(1)] = match.group(2)
    return services


@pytest.mark.skipif(not SEED_DOCUMENTS, reason=f"no seed design document in {SEED_DIR} to compare with")
def test_the_kept_seed_compose_kv_variables_are_the_seed_documents() -> None:
    seed = compose_kv_vars(SEED_DOCUMENTS[0].read_text())
    assert seed["prefill-server"]["VLLM_KV_ROLE"] == "prefill"  # the parser found the compose block
    assert seed == SEED_COMPOSE_KV


def test_seed_compose_kv_variables_are_a_subset_of_the_rendered_env() -> None:
    seed = SEED_COMPOSE_KV
    manifests = rendered(load_cr(ROOT / "crds/samples/seed-llama2-70b.yaml"))
    by_role = {m["metadata"]["name"].rsplit("-", 1)[1]: env_of(m) for m in of_kind(manifests, "StatefulSet")}
    renamed = {"VLLM_KV_DECODE_IP": "llama2-70b-decode"}  # decode-server there, the decode Service here
    for service, role in (("prefill-server", "prefill"), ("decode-server", "decode")):
        for name, value in seed[service].items():
            assert by_role[role][name] == renamed.get(name, value), (service, name)
    # The mooncake-transfer container's device is now in-process, on each engine; its one 16G buffer
    # became the per-role 4 GB / 8 GB VLLM_KV_BUFFER_SIZE_GB.
    assert seed["mooncake-transfer"]["MOONCAKE_RDMA_DEVICE"] == by_role["decode"]["MOONCAKE_RDMA_DEVICE"]
    assert (by_role["prefill"]["VLLM_KV_BUFFER_SIZE_GB"], by_role["decode"]["VLLM_KV_BUFFER_SIZE_GB"]) == (
        "4",
        "8",
    )


def test_compose_of_a_cpu_deployment_reserves_no_gpu() -> None:
    compose = yaml.safe_load(render_compose(parse(load_cr(ROOT / "crds/samples/cpu-tiny.yaml"))))
    for service in ("prefill-server", "decode-server"):
        assert "deploy" not in compose["services"][service]


def test_compose_mirrors_the_seed_topology() -> None:
    text = render_compose(parse(load_cr(ROOT / "crds/samples/seed-llama2-70b.yaml")))
    compose = yaml.safe_load(text)
    prefill, decode = compose["services"]["prefill-server"], compose["services"]["decode-server"]
    assert prefill["environment"]["VLLM_KV_DECODE_IP"] == "decode-server"
    assert prefill["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0", "1", "2", "3"]
    assert decode["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["4", "5", "6", "7"]
    assert decode["ports"] == ["127.0.0.1:${DLLM_DECODE_HOST_PORT:-8001}:8000"]
    assert compose["services"]["router"]["ports"] == ["127.0.0.1:${DLLM_ROUTER_HOST_PORT:-9000}:9000"]
    assert "--no-enable-chunked-prefill" in decode["command"]
    assert compose["services"]["router"]["entrypoint"] == ["dllm-router"]
    assert decode["entrypoint"] == ["dllm-serve"]
    assert decode["command"][0] == "--"


# ---- C2, H7, M4: isolation, authentication, non-root engines, the router's drain -----------------


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
            "secretKeyRef": {"name": "minimal-auth", "key": "kv-token"}
        }
        assert env["VLLM_API_KEY"]["valueFrom"] == {
            "secretKeyRef": {"name": "minimal-auth", "key": "api-key"}
        }
        assert "value" not in env["VLLM_API_KEY"]
    router = of_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert router["env"] == [
        {
            "name": "DLLM_ENGINE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "minimal-auth", "key": "api-key"}},
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


@pytest.mark.parametrize(
    ("limits", "body_mb"),
    [
        ({"memory": "1Gi"}, "8"),
        ({"memory": "512Mi"}, "4"),
        ({"memory": "64Mi"}, "1"),
        ({"memory": "64Gi"}, "64"),
        ({}, "8"),
    ],
)
def test_router_body_limit_follows_its_memory_limit(limits: dict[str, str], body_mb: str) -> None:
    resources = {"requests": {"memory": "64Mi"}, "limits": limits}
    pod = router_pod(rendered(merged(minimal(), {"spec": {"router": {"resources": resources}}})))
    assert flag(pod["containers"][0]["args"], "--max-body-mb") == body_mb


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
    hub = {"huggingFace": {"tokenSecretRef": {"name": "hf", "key": "token"}}}
    env = [{"name": "HF_TOKEN_COPY", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    body = merged(minimal(), {"spec": {"model": {"name": "m", "source": hub}, "decode": {"env": env}}})
    assert render_all(parse(body), OperatorConfig(allow_privileged_engines=False))
    pinned = OperatorConfig(allowed_image_prefixes=("registry.example/",))
    assert render_all(parse(merged(minimal(), {"spec": {"image": "registry.example/vllm:1"}})), pinned)
    with pytest.raises(SpecInvalid, match=r"spec.router.image: evil.example/r:1"):
        render_all(parse(merged(minimal(), {"spec": {"router": {"image": "evil.example/r:1"}}})), pinned)


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


def test_compose_takes_credentials_from_the_run_environment_and_holds_none() -> None:
    text = render_compose(parse(load_cr(ROOT / "crds/samples/cpu-tiny.yaml")))
    compose = yaml.safe_load(text)
    for service in ("prefill-server", "decode-server"):
        env = compose["services"][service]["environment"]
        assert (env["DLLM_KV_AUTH_TOKEN"], env["VLLM_API_KEY"]) == (None, None)  # passed through if set
        assert env["DLLM_KV_TRANSFER_PORTS"] == "61128-61255"
    router = compose["services"]["router"]
    assert router["environment"] == {"DLLM_ENGINE_API_KEY": "${VLLM_API_KEY:-}"}
    assert router["stop_grace_period"] == "630s"
    assert "--drain-seconds" in router["command"]
    off = merged(
        load_cr(ROOT / "crds/samples/cpu-tiny.yaml"), {"spec": {"security": {"authentication": False}}}
    )
    plain = yaml.safe_load(render_compose(parse(off)))
    assert "VLLM_API_KEY" not in plain["services"]["decode-server"]["environment"]
    assert "environment" not in plain["services"]["router"]
