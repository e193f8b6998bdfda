"""dllm-serve turns the seed's prefill and decode env into exactly the expected vLLM command."""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import pytest

from dllm_connector import serve
from dllm_contract import kvconfig

if TYPE_CHECKING:
    from conftest import Engine, FakeVllm, RunServe

pytestmark = pytest.mark.timeout(60)


API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

PREFILL_JSON = (
    '{"kv_role":"kv_producer","kv_port":50051,"engine_id":"llama2-70b-prefill-0-BOOT",'
    '"kv_load_failure_policy":"fail","kv_connector":"DllmMooncakeConnector",'
    '"kv_connector_module_path":"dllm_connector.connector","kv_connector_extra_config":{"compression":"fp8",'
    '"buffer_size_gb":4.0,"transfer_threshold_tokens":1024,"transfer_timeout_ms":5000,'
    '"prefill_wait_ms":60000,"hold_seconds":480,"async_transfer":true,"protocol":"tcp",'
    '"decode_host":"llama2-70b-decode","decode_port":50051,"rdma_devices":[],"gid_index":null,'
    '"host_ip":"10.0.0.5"}}'
)
DECODE_JSON = (
    '{"kv_role":"kv_consumer","kv_port":50051,"engine_id":"llama2-70b-decode-0-BOOT",'
    '"kv_load_failure_policy":"fail","kv_connector":"DllmMooncakeConnector",'
    '"kv_connector_module_path":"dllm_connector.connector","kv_connector_extra_config":{"compression":"fp8",'
    '"buffer_size_gb":8.0,"transfer_threshold_tokens":1024,"transfer_timeout_ms":5000,'
    '"prefill_wait_ms":60000,"hold_seconds":480,"async_transfer":true,"protocol":"tcp",'
    '"decode_host":null,"decode_port":null,"rdma_devices":[],"gid_index":null,"host_ip":"10.0.0.6"}}'
)
PREFILL_LINE = (
    f"MC_FORCE_TCP=1 MC_TCP_BIND_ADDRESS=10.0.0.5 {shlex.join(API_SERVER)} --model meta-llama/Llama-2-70b "
    "--tensor-parallel-size 4 --max-num-seqs 64 --max-num-batched-tokens 8192 --port 8000 "
    f"--middleware dllm_connector.key_guard.EngineKeyGuard --kv-transfer-config '{PREFILL_JSON}'"
)
DECODE_LINE = (
    f"MC_FORCE_TCP=1 MC_TCP_BIND_ADDRESS=10.0.0.6 DLLM_END_ROUTE_TP_SIZE=4 {shlex.join(API_SERVER)} "
    "--middleware dllm_connector.end_route.EndTransferRoute --model meta-llama/Llama-2-70b "
    "--tensor-parallel-size 4 --max-num-seqs 256 --max-num-batched-tokens 2048 --no-enable-chunked-prefill "
    "--port 8001 --middleware dllm_connector.key_guard.EngineKeyGuard "
    f"--kv-transfer-config '{DECODE_JSON}'"
)
KEY_GUARD = ["--middleware", "dllm_connector.key_guard.EngineKeyGuard"]
BOOT_ID = re.compile(r'"engine_id":"(?P<pod>[a-z0-9-]+)-(?P<boot>[0-9a-f]{8})"')


def _with_fixed_boot_id(line: str) -> str:
    """The printed line with its random boot id replaced by BOOT (after checking its shape)."""
    found = BOOT_ID.search(line)
    assert found is not None, line
    return line.replace(f"{found['pod']}-{found['boot']}", f"{found['pod']}-BOOT")


@pytest.mark.parametrize(
    ("engine", "expected"), [("seed_prefill", PREFILL_LINE), ("seed_decode", DECODE_LINE)]
)
def test_print_gives_the_exact_command_for_the_seed_engines(
    engine: str, expected: str, run_serve: RunServe, request: pytest.FixtureRequest
) -> None:
    seed: Engine = request.getfixturevalue(engine)
    result = run_serve(["--print", "--", *seed.args], seed.env)
    assert result.returncode == 0, result.stderr
    assert _with_fixed_boot_id(result.stdout.strip()) == expected


def test_build_command_for_seed_prefill_is_exact(seed_prefill: Engine) -> None:
    command = serve.build_command(
        seed_prefill.env,
        seed_prefill.args,
        serve.Launcher.API_SERVER,
        hostname="ignored-when-DLLM_ENGINE_ID-is-set",
        boot_id="BOOT",
        python=sys.executable,
    )
    assert command.argv == (
        *API_SERVER,
        *seed_prefill.args,
        *KEY_GUARD,
        "--kv-transfer-config",
        PREFILL_JSON,
    )
    assert command.added_env == {"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": "10.0.0.5"}


class _BuildArgs(TypedDict):
    """serve.build_command's arguments after the env."""

    engine_args: Sequence[str]
    launcher: serve.Launcher
    hostname: str
    boot_id: str
    python: str


def test_the_env_the_operator_writes_gives_the_same_command(seed_prefill: Engine) -> None:
    """kvconfig.to_env (operator side) and dllm-serve (pod side) agree through one model."""
    settings = kvconfig.from_env(seed_prefill.env)
    rendered = kvconfig.to_env(settings)
    build: _BuildArgs = {
        "engine_args": seed_prefill.args,
        "launcher": serve.Launcher.API_SERVER,
        "hostname": "h",
        "boot_id": "b",
        "python": "python3",
    }
    from_literal = serve.build_command(seed_prefill.env, **build)
    from_operator = serve.build_command(rendered, **build)
    assert from_operator == from_literal


def test_each_start_gets_a_fresh_boot_id_on_the_same_pod_name(
    seed_decode: Engine, run_serve: RunServe
) -> None:
    first = run_serve(["--print", "--", *seed_decode.args], seed_decode.env)
    second = run_serve(["--print", "--", *seed_decode.args], seed_decode.env)
    ids = [BOOT_ID.search(result.stdout) for result in (first, second)]
    assert all(found is not None for found in ids)
    assert {found["pod"] for found in ids if found} == {"llama2-70b-decode-0"}
    assert len({found["boot"] for found in ids if found}) == 2


def test_engine_id_falls_back_to_the_hostname(seed_decode: Engine) -> None:
    del seed_decode.env["DLLM_ENGINE_ID"]
    settings = kvconfig.from_env(seed_decode.env)
    assert serve.engine_id(settings, hostname="decode-7", boot_id="0a1b2c3d") == "decode-7-0a1b2c3d"


def test_vllm_cli_launcher_runs_vllm_serve(seed_decode: Engine, run_serve: RunServe) -> None:
    result = run_serve(["--print", "--launcher", "vllm-cli", "--", *seed_decode.args], seed_decode.env)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    start = argv.index("vllm")  # after the added env (A=1 ...)
    assert argv[start : start + 2] == ["vllm", "serve"]
    assert argv[start + 2 : start + 4] == ["--middleware", "dllm_connector.end_route.EndTransferRoute"]
    assert argv[start + 4 : -4] == seed_decode.args
    assert argv[-4:-2] == KEY_GUARD


def test_launcher_comes_from_the_env_and_the_flag_wins(seed_decode: Engine, run_serve: RunServe) -> None:
    env = {**seed_decode.env, "DLLM_SERVE_LAUNCHER": "vllm-cli"}
    from_env = shlex.split(run_serve(["--print", "--", "--port", "8001"], env).stdout)
    from_flag = shlex.split(run_serve(["--print", "--launcher", "api-server", "--"], env).stdout)
    assert from_env[3:5] == ["vllm", "serve"]  # after three added env entries
    assert from_flag[4:6] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_mooncake_env_respects_what_the_user_set(seed_prefill: Engine) -> None:
    env = {**seed_prefill.env, "MC_FORCE_TCP": "0", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    settings = kvconfig.from_env(env)
    assert serve.mooncake_env(settings, env) == {}


def test_rdma_protocol_does_not_force_tcp_and_no_host_ip_binds_nothing(seed_decode: Engine) -> None:
    env = {**seed_decode.env, "MOONCAKE_PROTOCOL": "rdma"}
    del env["VLLM_HOST_IP"]
    assert serve.mooncake_env(kvconfig.from_env(env), env) == {}


def test_resolved_configuration_is_logged_once_without_secrets(
    seed_prefill: Engine, run_serve: RunServe
) -> None:
    env = {
        **seed_prefill.env,
        "HF_TOKEN": "hf_sekrit1",
        "VLLM_KV_CONNECTOR": "custom",
        "VLLM_KV_CONNECTOR_CLASS": "MyConnector",
        "VLLM_KV_CONNECTOR_MODULE_PATH": "my_pkg.conn",
        "VLLM_KV_CONNECTOR_EXTRA_CONFIG": json.dumps({"api_token": "sekrit2", "nested": {"key": "sekrit3"}}),
    }
    args = ["--model", "m", "--api-key", "sekrit4", "--hf-token=sekrit5", "--max-num-batched-tokens", "64"]
    result = run_serve(["--print", "--", *args], env)
    assert result.returncode == 0, result.stderr
    log_lines = [line for line in result.stderr.splitlines() if "resolved configuration" in line]
    assert len(log_lines) == 1
    assert "sekrit" not in result.stderr
    assert '"--max-num-batched-tokens","64"' in log_lines[0]
    assert '"kv_connector":"MyConnector"' in log_lines[0]


def test_good_env_execs_vllm_with_the_config_and_mooncake_env(
    seed_prefill: Engine, run_serve: RunServe, fake_vllm: FakeVllm
) -> None:
    env = {**seed_prefill.env, "DLLM_SERVE_LAUNCHER": "vllm-cli"}
    result = run_serve(["--", *seed_prefill.args], env, fake_vllm)
    assert result.returncode == 0, result.stderr
    record = fake_vllm.record()
    assert record["argv"][0] == "serve"
    assert record["argv"][1:-4] == seed_prefill.args
    assert record["argv"][-4:-2] == KEY_GUARD
    sent = json.loads(record["argv"][-1])
    assert sent["kv_role"] == "kv_producer"
    assert sent["kv_connector_extra_config"]["decode_host"] == "llama2-70b-decode"
    expected_env = {"MC_FORCE_TCP": "1", "MC_TCP_BIND_ADDRESS": "10.0.0.5", "VLLM_KV_ROLE": "prefill"}
    assert record["env"] == expected_env


def test_a_missing_vllm_program_is_one_clear_line(
    seed_decode: Engine, run_serve: RunServe, tmp_path: Path
) -> None:
    env = {**seed_decode.env, "DLLM_SERVE_LAUNCHER": "vllm-cli", "PATH": str(tmp_path)}
    result = run_serve(["--"], env)
    assert result.returncode == 127
    assert result.stderr.splitlines()[-1] == (
        "dllm-serve: cannot start vllm: No such file or directory (set DLLM_SERVE_LAUNCHER=api-server)"
    )


@pytest.mark.parametrize(
    ("name", "secret"),
    [("HF_TOKEN", True), ("api_key", True), ("--api-key", True), ("db_password", True),
     ("client-secret", True), ("transfer_threshold_tokens", False), ("max-num-batched-tokens", False),
     ("tokenizer", False), ("kv_connector", False)],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert serve.is_secret_name(name) is secret


# ---- the end route (security review M2): decode's engine serves POST /v1/dllm/end_transfer -----------

END_ROUTE = ["--middleware", "dllm_connector.end_route.EndTransferRoute"]


def _build(env: Mapping[str, str], args: Sequence[str]) -> serve.ServeCommand:
    return serve.build_command(
        env, args, serve.Launcher.API_SERVER, hostname="h", boot_id="b", python="python3"
    )


def test_decode_gets_the_end_route_with_its_tp_size_and_prefill_does_not(
    seed_decode: Engine, seed_prefill: Engine
) -> None:
    decode = _build(seed_decode.env, seed_decode.args)
    assert list(decode.argv[3:5]) == END_ROUTE  # after the launcher, before the engine args
    assert decode.added_env["DLLM_END_ROUTE_TP_SIZE"] == "4"
    prefill = _build(seed_prefill.env, seed_prefill.args)
    assert "dllm_connector.end_route.EndTransferRoute" not in prefill.argv
    assert "DLLM_END_ROUTE_TP_SIZE" not in prefill.added_env


def test_kv_both_gets_the_end_route_and_a_custom_connector_does_not(seed_decode: Engine) -> None:
    both = _build({**seed_decode.env, "VLLM_KV_ROLE": "both"}, ["--model", "m"])
    assert list(both.argv[3:5]) == END_ROUTE
    assert both.added_env["DLLM_END_ROUTE_TP_SIZE"] == "1"
    custom_env = {
        **seed_decode.env,
        "VLLM_KV_CONNECTOR": "custom",
        "VLLM_KV_CONNECTOR_CLASS": "MyConnector",
        "VLLM_KV_CONNECTOR_MODULE_PATH": "my_pkg.conn",
    }
    custom = _build(custom_env, ["--model", "m"])
    assert "dllm_connector.end_route.EndTransferRoute" not in custom.argv


def test_a_users_own_middleware_is_kept_next_to_the_end_route(seed_decode: Engine) -> None:
    args = ["--model", "m", "--middleware", "my_pkg.Mine"]
    command = _build(seed_decode.env, args)
    assert command.argv.count("--middleware") == 3  # vLLM's flag appends
    assert "my_pkg.Mine" in command.argv


def test_every_engine_gets_the_key_guard_last_of_its_middlewares(
    seed_decode: Engine, seed_prefill: Engine
) -> None:
    """vLLM adds middlewares in the order of its flags and the last added runs first: the guard comes
    after the engine args, a user's own middleware included, so nothing runs before it (NEW-3)."""
    for engine in (seed_prefill, seed_decode):
        command = _build(engine.env, [*engine.args, "--middleware", "my_pkg.Mine"])
        middlewares = [command.argv[i + 1] for i, a in enumerate(command.argv) if a == "--middleware"]
        assert middlewares[-1] == "dllm_connector.key_guard.EngineKeyGuard", middlewares
    custom_env = {
        **seed_decode.env,
        "VLLM_KV_CONNECTOR": "custom",
        "VLLM_KV_CONNECTOR_CLASS": "MyConnector",
        "VLLM_KV_CONNECTOR_MODULE_PATH": "my_pkg.conn",
    }
    assert list(_build(custom_env, ["--model", "m"]).argv[-4:-2]) == KEY_GUARD


def test_the_key_guard_and_end_route_get_the_api_key_flags_values(seed_prefill: Engine) -> None:
    command = _build(seed_prefill.env, [*seed_prefill.args, "--api-key", "k1", "k2"])
    assert command.added_env["DLLM_END_ROUTE_API_KEY"] == "k1\nk2"


@pytest.mark.parametrize(
    ("args", "size"),
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--tensor-parallel-size=8"], 8),
        (["--tensor_parallel_size", "4"], 4),
        (["-tp", "2"], 2),
        (["-tp=4"], 4),
        (["-tp", "2", "--tensor-parallel-size", "8"], 8),  # the last wins, as in argparse
    ],
)
def test_the_tp_size_is_read_from_every_spelling(args: list[str], size: int) -> None:
    assert serve.tensor_parallel_size(args) == size


@pytest.mark.parametrize(
    "args", [["--tensor-parallel-size", "zero"], ["-tp", "0"], ["--tensor-parallel-size"]]
)
def test_a_bad_tp_size_is_one_clear_line(seed_decode: Engine, run_serve: RunServe, args: list[str]) -> None:
    result = run_serve(["--print", "--", "--model", "m", *args], seed_decode.env)
    assert result.returncode == 2
    assert "--tensor-parallel-size" in result.stderr
    assert "must be a whole number" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "keys"),
    [
        (["--api-key", "k1"], "k1"),
        (["--api-key=k1"], "k1"),
        (["--api-key", "k1", "k2", "--port", "8001"], "k1\nk2"),
        (["--api-key", "k0", "--api_key", "k1"], "k1"),  # the last wins, as in argparse
    ],
)
def test_vllms_api_key_flag_reaches_the_end_route_and_no_log(
    seed_decode: Engine, run_serve: RunServe, args: list[str], keys: str
) -> None:
    command = _build(seed_decode.env, ["--model", "m", *args])
    assert command.added_env["DLLM_END_ROUTE_API_KEY"] == keys
    result = run_serve(["--print", "--", "--model", "m", *args], seed_decode.env)
    assert result.returncode == 0, result.stderr
    assert '"DLLM_END_ROUTE_API_KEY":"<redacted>"' in result.stderr
    assert "k1" not in result.stderr
    assert "k2" not in result.stderr  # every value of the flag is hidden in the logged engine args


def test_without_the_flag_the_route_reads_vllm_api_key_itself(seed_decode: Engine) -> None:
    command = _build({**seed_decode.env, "VLLM_API_KEY": "from-the-secret"}, ["--model", "m"])
    assert "DLLM_END_ROUTE_API_KEY" not in command.added_env
