"""The docker-compose render: the seed design's compose shape, its KV variables, and credentials that
come from the run's environment rather than the file."""

from __future__ import annotations

import re

import pytest
import yaml
from dllm_cases import ROOT, load_cr, merged
from rendered import env_of, of_kind, rendered

from dllm_operator.api import parse
from dllm_operator.render.compose import render_compose

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


def test_compose_takes_credentials_from_the_run_environment_and_holds_none() -> None:
    text = render_compose(parse(load_cr(ROOT / "crds/samples/cpu-tiny.yaml")))
    compose = yaml.safe_load(text)
    for service in ("prefill-server", "decode-server"):
        env = compose["services"][service]["environment"]
        for name in ("DLLM_KV_AUTH_TOKEN", "VLLM_API_KEY"):  # required from the run's environment
            assert env[name].startswith("${" + name + ":?" + name + " is unset"), env[name]
        assert env["DLLM_KV_TRANSFER_PORTS"] == "61128-61255"
    router = compose["services"]["router"]
    assert router["environment"] == {
        "DLLM_ENGINE_API_KEY": compose["services"]["decode-server"]["environment"]["VLLM_API_KEY"]
    }
    assert router["stop_grace_period"] == "630s"
    assert "--drain-seconds" in router["command"]
    off = merged(
        load_cr(ROOT / "crds/samples/cpu-tiny.yaml"), {"spec": {"security": {"authentication": False}}}
    )
    plain = yaml.safe_load(render_compose(parse(off)))
    assert "VLLM_API_KEY" not in plain["services"]["decode-server"]["environment"]
    assert "environment" not in plain["services"]["router"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("X: 1\n    privileged: true\n    Y", "plain"),  # a name that was YAML once written unquoted
        ("NOTE", "a\n    privileged: true\nb: [c]"),
        ("QUOTES", "'\"}]{ # not a comment"),
    ],
)
def test_a_crs_env_cannot_change_the_compose_documents_shape(name: str, value: str) -> None:
    """Env names and values reach the file as data, quoted as YAML needs (redesign.md 5.3, finding 5:
    names were written unquoted)."""
    env = [{"name": name, "value": value}]
    body = merged(load_cr(ROOT / "crds/samples/cpu-tiny.yaml"), {"spec": {"decode": {"env": env}}})
    compose = yaml.safe_load(render_compose(parse(body)))
    decode = compose["services"]["decode-server"]
    assert decode["environment"][name] == value
    assert "privileged" not in decode
    assert set(compose) == {"services", "networks"}
    assert set(compose["services"]) == {"prefill-server", "decode-server", "router"}
