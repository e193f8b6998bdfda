"""The design document's compose env, exactly as written, starts both engines (issue 19, item 2).

The seed (shared/seed, "集成配置示例") gives each engine only a few VLLM_KV_* variables and runs Mooncake
as a service of its own with MOONCAKE_RDMA_DEVICE and MOONCAKE_BUFFER_SIZE. dllm-serve fills in what the
seed leaves out with the documented defaults (docs/images.md), and takes the Mooncake service's settings
when an engine is given them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from dllm_contract import kvconfig

if TYPE_CHECKING:
    from conftest import FakeVllm, RunServe

# Copied verbatim from the seed's docker-compose.yml (prefill-server, decode-server, mooncake-transfer).
SEED_PREFILL = {
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "VLLM_KV_CONNECTOR": "mooncake",
    "VLLM_KV_ROLE": "prefill",
    "VLLM_KV_DECODE_IP": "decode-server",
    "VLLM_KV_DECODE_PORT": "50051",
}
SEED_DECODE = {
    "CUDA_VISIBLE_DEVICES": "4,5,6,7",
    "VLLM_KV_CONNECTOR": "mooncake",
    "VLLM_KV_ROLE": "decode",
    "VLLM_KV_LISTEN_PORT": "50051",
}
SEED_MOONCAKE_SERVICE = {"MOONCAKE_RDMA_DEVICE": "mlx5_0", "MOONCAKE_BUFFER_SIZE": "16G"}
MODEL = ["--model", "meta-llama/Llama-2-70b", "--tensor-parallel-size", "4"]


def _kv_config(stdout: str) -> dict[str, object]:
    flag = " --kv-transfer-config "
    assert flag in stdout, stdout
    raw = stdout.split(flag, 1)[1].strip()
    loaded: dict[str, object] = json.loads(raw.removeprefix("'").removesuffix("'"))
    return loaded


@pytest.mark.parametrize(
    ("env", "role", "port"),
    [(SEED_PREFILL, "kv_producer", 50051), (SEED_DECODE, "kv_consumer", 50051)],
    ids=["prefill", "decode"],
)
def test_each_seed_engine_starts_from_the_seed_env_alone(
    env: dict[str, str], role: str, port: int, run_serve: RunServe, fake_vllm: FakeVllm
) -> None:
    result = run_serve(["--print", "--", *MODEL], env, fake_vllm)
    assert result.returncode == 0, result.stderr
    config = _kv_config(result.stdout)
    assert config["kv_role"] == role
    assert config["kv_port"] == port
    extra = config["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    assert extra["buffer_size_gb"] == kvconfig.DEFAULT_BUFFER_SIZE_GB
    assert extra["protocol"] == "tcp"


def test_the_prefill_engine_sends_to_the_seeds_decode_server() -> None:
    settings = kvconfig.from_env(SEED_PREFILL)
    assert (settings.decode_host, settings.decode_port) == ("decode-server", 50051)
    assert settings.listen_port == kvconfig.DEFAULT_KV_PORT


def test_the_mooncake_services_settings_are_understood_by_an_engine() -> None:
    settings = kvconfig.from_env({**SEED_DECODE, **SEED_MOONCAKE_SERVICE})
    assert settings.buffer_size_gb == 16.0  # 16G, in the contract's GB of 2^30 bytes
    assert settings.rdma_devices == ("mlx5_0",)
    assert settings.protocol is kvconfig.Protocol.RDMA  # a device without a protocol means RDMA


def test_the_contracts_own_variables_win_over_the_mooncake_services() -> None:
    env = {**SEED_DECODE, **SEED_MOONCAKE_SERVICE, "VLLM_KV_BUFFER_SIZE_GB": "2", "MOONCAKE_PROTOCOL": "tcp"}
    settings = kvconfig.from_env(env)
    assert (settings.buffer_size_gb, settings.protocol) == (2.0, kvconfig.Protocol.TCP)


@pytest.mark.parametrize("size", ["16X", "lots", "0G", "-1G", "infG"])
def test_a_bad_mooncake_buffer_size_is_refused_naming_the_variable(
    size: str, run_serve: RunServe, fake_vllm: FakeVllm
) -> None:
    result = run_serve(["--", *MODEL], {**SEED_DECODE, "MOONCAKE_BUFFER_SIZE": size}, fake_vllm)
    assert result.returncode == 2
    assert result.stderr.startswith(f"dllm-serve: MOONCAKE_BUFFER_SIZE: {size!r} must be a size")
    assert not fake_vllm.started()


@pytest.mark.parametrize(
    ("size", "gb"), [("512M", 0.5), ("16GiB", 16.0), ("16GB", 16.0), ("1073741824", 1.0)]
)
def test_mooncake_buffer_sizes_in_their_usual_forms(size: str, gb: float) -> None:
    settings = kvconfig.from_env({**SEED_DECODE, "MOONCAKE_BUFFER_SIZE": size})
    assert settings.buffer_size_gb == gb
