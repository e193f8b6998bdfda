"""Rendering basics: reviewable snapshots of every sample, the invariants a user relies on, and where
pods, replicas and labels land. The compose file is checked in test_render_compose.py, isolation and the
operator's refusals in test_render_isolation.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from dllm_cases import ROOT, SAMPLES, load_cr, merged, minimal
from rendered import UID, env_of, of_kind, rendered

from dllm_contract.kvconfig import CONTRACT_ENV_NAMES, DOWNWARD_API_ENV
from dllm_operator.render import HASH_ANNOTATION

SNAPSHOTS = Path(__file__).parent / "snapshots"
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


def router_argv(body: dict[str, Any]) -> list[str]:
    deployment = of_kind(rendered(body), "Deployment")[0]
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


@pytest.mark.parametrize(
    ("patch", "check"),
    [
        ({}, ["--kv-check-interval-s", "300"]),  # tcp unless RDMA is on
        ({"rdma": {"enabled": True}}, ["--kv-check-interval-s", "300", "--kv-check-rdma", "true"]),
        ({"rdma": {"enabled": True}, "kvTransfer": {"protocol": "tcp"}}, ["--kv-check-interval-s", "300"]),
        ({"router": {"flow": "nixl"}}, []),  # vLLM's own connectors keep no record to read
        ({"kvTransfer": {"connector": "custom", "custom": {"connectorClass": "NixlConnector"}}}, []),
    ],
)
def test_the_router_checks_kv_on_our_connector_expecting_rdma_where_mooncake_uses_it(
    patch: dict[str, Any], check: list[str]
) -> None:
    argv = router_argv(merged(minimal(), {"spec": patch}))
    found = argv[argv.index("--kv-check-interval-s") :] if "--kv-check-interval-s" in argv else []
    assert found == check


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
