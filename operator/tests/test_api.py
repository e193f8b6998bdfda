"""The typed model accepts what the CRD accepts and refuses what it refuses, naming the same field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dllm_cases import CRD_PATH, INVALID, ROOT, SAMPLES, invalid_body, load_cr, merged, minimal

from dllm_contract.kvconfig import Compression, Connector
from dllm_operator import crd
from dllm_operator.api import MAX_NAME_LENGTH, RESERVED_ENV_NAMES, SpecInvalid, parse
from dllm_operator.render import auth, render_all
from dllm_operator.render.ports import TRANSFER_PORTS_ENV


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_every_sample_parses(path: Path) -> None:
    cr = parse(load_cr(path))
    assert cr.name == load_cr(path)["metadata"]["name"]


def test_minimal_resource_gets_the_documented_defaults() -> None:
    cr = parse(minimal())
    kv = cr.spec.kv_transfer
    assert (kv.connector, kv.compression, kv.port, kv.buffer_size_gb) == (
        Connector.MOONCAKE,
        Compression.NONE,
        50051,
        4.0,
    )
    assert (kv.transfer_threshold_tokens, kv.timeout_ms, kv.prefill_wait_ms, kv.hold_seconds) == (
        1024,
        5000,
        60000,
        480,
    )
    assert (cr.spec.prefill.max_num_seqs, cr.spec.prefill.max_num_batched_tokens) == (64, 8192)
    assert (cr.spec.decode.max_num_seqs, cr.spec.decode.max_num_batched_tokens) == (256, 2048)
    assert cr.spec.decode.enable_chunked_prefill is False
    assert cr.spec.prefill.enable_chunked_prefill is None
    assert cr.spec.prefill.replicas is None  # left to an autoscaler
    assert cr.spec.router.enabled
    assert cr.spec.router.flow == "auto"


def test_seed_sample_matches_the_seed_topology() -> None:
    cr = parse(load_cr(ROOT / "crds" / "samples" / "seed-llama2-70b.yaml"))
    p, d = cr.spec.prefill, cr.spec.decode
    assert (p.tensor_parallel_size, p.max_num_seqs, p.max_num_batched_tokens) == (4, 64, 8192)
    assert (d.tensor_parallel_size, d.max_num_seqs, d.max_num_batched_tokens) == (4, 256, 2048)
    assert d.enable_chunked_prefill is False
    assert cr.spec.model.max_model_len == 2048
    assert cr.spec.kv_transfer.compression is Compression.FP8
    assert cr.spec.rdma.enabled
    assert cr.spec.rdma.devices == ("mlx5_0",)
    assert (p.buffer_size_gb, d.buffer_size_gb) == (4.0, 8.0)


@pytest.mark.parametrize(("case", "patch", "path"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_resource_is_refused_naming_the_field(case: str, patch: dict[str, object], path: str) -> None:
    with pytest.raises(SpecInvalid) as refused:
        parse(invalid_body(patch, "bad"))
    paths = [error.path for error in refused.value.errors]
    assert path in paths, f"{case}: expected {path} in {paths}"


def test_the_longest_name_is_accepted_and_every_name_kubernetes_derives_stays_a_label() -> None:
    """44 characters (name-too-long refuses 45): each child's name and label values fit a label's 63
    characters, and so does the controller-revision-hash label a StatefulSet's pods get (its name, a dash
    and a 10-character hash), which is what sets the limit."""
    name = "a" * MAX_NAME_LENGTH
    uid = "00000000-0000-0000-0000-000000000001"
    children = render_all(parse(merged(minimal(name), {"metadata": {"namespace": "ns", "uid": uid}})))
    for child in children:
        meta = child["metadata"]
        assert len(meta["name"]) <= 63, meta["name"]
        assert all(len(value) <= 63 for value in meta.get("labels", {}).values()), meta["labels"]
    statefulsets = [c["metadata"]["name"] for c in children if c["kind"] == "StatefulSet"]
    assert len(statefulsets) == 2
    assert max(len(f"{sts}-{'0' * 10}") for sts in statefulsets) == 63


def test_at_least_25_invalid_cases() -> None:
    assert len(INVALID) >= 25


def test_security_is_on_unless_turned_off() -> None:
    """Existing YAML gets isolation and authentication; a user turns either off explicitly."""
    security = parse(minimal()).spec.security
    assert (security.network_policy, security.authentication) == (True, True)
    off = parse(merged(minimal(), {"spec": {"security": {"networkPolicy": False, "authentication": False}}}))
    assert (off.spec.security.network_policy, off.spec.security.authentication) == (False, False)


def test_router_grace_default_covers_the_request_timeout() -> None:
    assert parse(minimal()).spec.router.termination_grace_period_seconds == 630


def test_operator_owned_env_names_are_reserved() -> None:
    for name in (auth.KV_TOKEN_ENV, auth.ENGINE_API_KEY_ENV, auth.ROUTER_API_KEY_ENV, TRANSFER_PORTS_ENV):
        assert name in RESERVED_ENV_NAMES
        body = merged(minimal(), {"spec": {"decode": {"env": [{"name": name, "value": "x"}]}}})
        with pytest.raises(SpecInvalid, match=rf"spec.decode.env: .*{name}"):
            parse(body)
    crd_rule = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    env_rule = crd_rule["properties"]["spec"]["properties"]["prefill"]["properties"]["env"]
    for name in RESERVED_ENV_NAMES:
        assert f"'{name}'" in env_rule["x-kubernetes-validations"][0]["rule"]


@pytest.mark.parametrize("name", ["HF_ENDPOINT", "HF_HUB_CACHE", "HF_HUB_ENDPOINT", "HF_HUB_ANYTHING_NEW"])
def test_env_may_not_say_where_the_hub_token_goes(name: str) -> None:
    """NEW-4: huggingface_hub sends HF_TOKEN to HF_ENDPOINT; a mirror is the operator's setting."""
    body = merged(minimal(), {"spec": {"prefill": {"env": [{"name": name, "value": "https://elsewhere"}]}}})
    with pytest.raises(SpecInvalid, match=rf"spec.prefill.env: .*{name}"):
        parse(body)


@pytest.mark.parametrize("name", ["SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_env_may_not_choose_which_authorities_https_trusts(name: str) -> None:
    """With a CA of the resource's choosing, a proxy it also names would read the hub token in TLS."""
    body = merged(minimal(), {"spec": {"decode": {"env": [{"name": name, "value": "/models/ca.pem"}]}}})
    with pytest.raises(SpecInvalid, match=rf"spec.decode.env: .*{name}"):
        parse(body)


def test_the_hubs_on_off_switches_stay_open_to_env() -> None:
    env = [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HF_HUB_ENABLE_HF_TRANSFER", "value": "1"}]
    assert parse(merged(minimal(), {"spec": {"decode": {"env": env}}})).spec.decode.env


def test_missing_spec_is_refused() -> None:
    with pytest.raises(SpecInvalid, match=r"^spec: Required value$"):
        parse({"metadata": {"name": "x"}})


def test_committed_crd_is_what_the_model_gives() -> None:
    assert CRD_PATH.read_text() == crd.render(), "run `make crds` and commit the result"


def test_crd_shape() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["dllm"]
    assert crd["spec"]["names"]["categories"] == ["all", "llm"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Prefill",
        "Decode",
        "Ready",
        "Connector",
        "KV",
        "Age",
    ]
    text = CRD_PATH.read_text()
    # Unknown fields are kept only where a core type or a free-form map is passed through: per role
    # env[].valueFrom, affinity and topologySpreadConstraints[]; kvTransfer.custom.extraConfig; and the
    # NetworkPolicyPeers of security.routerAllowedFrom[] and engineAllowedFrom[].
    assert text.count("x-kubernetes-preserve-unknown-fields") == 2 * 3 + 1 + 2


def test_render_cli_refuses_an_invalid_file_without_partial_output(tmp_path: Path) -> None:
    good = yaml.safe_dump(minimal("good"))
    bad = yaml.safe_dump(invalid_body({"spec": {"kvTransfer": {"port": 70000}}}, "bad"))
    path = tmp_path / "two.yaml"
    path.write_text(good + "---\n" + bad)
    result = subprocess.run(
        [sys.executable, "-m", "dllm_operator", "render", "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert "spec.kvTransfer.port" in result.stderr
    assert "less than or equal to 65535" in result.stderr


def test_render_cli_refuses_a_file_without_a_resource(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("kind: ConfigMap\n")
    result = subprocess.run(
        [sys.executable, "-m", "dllm_operator", "render", "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert "no DisaggregatedLLM resource found" in result.stderr


def test_render_cli_applies_the_operator_policy_from_its_environment(tmp_path: Path) -> None:
    path = tmp_path / "cr.yaml"
    path.write_text(
        yaml.safe_dump(merged(minimal(), {"spec": {"rdma": {"enabled": True, "hostNetwork": True}}}))
    )
    command = [sys.executable, "-m", "dllm_operator", "render", "-f", str(path)]

    def run(value: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "DLLM_ALLOW_PRIVILEGED_ENGINES": value}
        return subprocess.run(command, capture_output=True, text=True, check=False, env=env)

    assert run("true").returncode == 0
    refused = run("false")
    assert (refused.returncode, refused.stdout) == (2, "")
    assert "spec.rdma.hostNetwork: host network needs" in refused.stderr
    bad = run("maybe")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert "DLLM_ALLOW_PRIVILEGED_ENGINES: 'maybe' is not true or false" in bad.stderr


def test_bad_resource_quantity_is_refused_naming_its_key_as_the_api_server_does() -> None:
    """The API server says `spec.prefill.resources.limits.cpu: Invalid value: "lots"`; so does the model."""
    body = merged(
        minimal(), {"spec": {"prefill": {"resources": {"limits": {"cpu": "lots", "memory": "1Gi"}}}}}
    )
    with pytest.raises(SpecInvalid) as refused:
        parse(body)
    assert [str(error) for error in refused.value.errors] == [
        "spec.prefill.resources.limits.cpu: 'lots' is not a quantity (e.g. 16Gi, 500m, 2)"
    ]


@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_a_yaml_infinity_or_nan_is_no_buffer_size(value: str) -> None:
    """YAML has them (JSON, and so the API server, has not): `dllm-operator render -f` refuses them."""
    body = merged(minimal("m"), {"spec": {"kvTransfer": {"bufferSizeGB": yaml.safe_load(value)}}})
    with pytest.raises(SpecInvalid) as refused:
        parse(body)
    assert "spec.kvTransfer.bufferSizeGB" in [error.path for error in refused.value.errors]
