"""A bad env or bad engine args: exit 2, one line naming the variable and what it allows, no vLLM."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Engine, FakeVllm, RunServe

pytestmark = pytest.mark.timeout(60)


PREFILL = "seed_prefill"
DECODE = "seed_decode"
CUSTOM = {"VLLM_KV_CONNECTOR": "custom", "VLLM_KV_CONNECTOR_CLASS": "MyConnector"}

# (id, engine, env changes (None removes), words the one line must contain)
BAD_ENV = [
    ("unknown connector", DECODE, {"VLLM_KV_CONNECTOR": "nixl"},
     ["VLLM_KV_CONNECTOR", "'nixl'", "mooncake, pynccl, custom"]),
    ("role not prefill/decode/both", DECODE, {"VLLM_KV_ROLE": "kv_consumer"},
     ["VLLM_KV_ROLE", "'kv_consumer'", "prefill, decode, both"]),
    ("listen port above range", DECODE, {"VLLM_KV_LISTEN_PORT": "70000"},
     ["VLLM_KV_LISTEN_PORT", "'70000'", "1..65535"]),
    ("listen port zero", DECODE, {"VLLM_KV_LISTEN_PORT": "0"}, ["VLLM_KV_LISTEN_PORT", "1..65535"]),
    ("listen port not a number", DECODE, {"VLLM_KV_LISTEN_PORT": "fifty"},
     ["VLLM_KV_LISTEN_PORT", "'fifty'", "1..65535"]),
    ("decode port out of range", PREFILL, {"VLLM_KV_DECODE_PORT": "65536"},
     ["VLLM_KV_DECODE_PORT", "1..65535"]),
    ("negative buffer", DECODE, {"VLLM_KV_BUFFER_SIZE_GB": "-8"},
     ["VLLM_KV_BUFFER_SIZE_GB", "'-8'", "greater than 0"]),
    ("zero buffer", DECODE, {"VLLM_KV_BUFFER_SIZE_GB": "0"}, ["VLLM_KV_BUFFER_SIZE_GB", "greater than 0"]),
    ("compression not none/fp8/int8", DECODE, {"VLLM_KV_COMPRESSION": "zstd"},
     ["VLLM_KV_COMPRESSION", "'zstd'", "none, fp8, int8"]),
    ("prefill without decode ip", PREFILL, {"VLLM_KV_DECODE_IP": None},
     ["VLLM_KV_DECODE_IP", "VLLM_KV_ROLE=prefill"]),
    ("custom without a class", DECODE, {**CUSTOM, "VLLM_KV_CONNECTOR_CLASS": None},
     ["VLLM_KV_CONNECTOR_CLASS", "VLLM_KV_CONNECTOR=custom"]),
    ("custom extra config not an object", DECODE, {**CUSTOM, "VLLM_KV_CONNECTOR_EXTRA_CONFIG": "[1]"},
     ["VLLM_KV_CONNECTOR_EXTRA_CONFIG", "JSON object"]),
    ("async not a boolean", DECODE, {"VLLM_KV_ASYNC": "sometimes"}, ["VLLM_KV_ASYNC", "true or false"]),
    ("protocol unknown", DECODE, {"MOONCAKE_PROTOCOL": "udp"}, ["MOONCAKE_PROTOCOL", "rdma, tcp"]),
    ("role missing", DECODE, {"VLLM_KV_ROLE": None}, ["VLLM_KV_ROLE", "required"]),
    ("value with a newline stays on one line", DECODE, {"VLLM_KV_ROLE": "pre\nfill"},
     ["VLLM_KV_ROLE", "prefill, decode, both"]),
    ("unknown launcher", DECODE, {"DLLM_SERVE_LAUNCHER": "ray"},
     ["DLLM_SERVE_LAUNCHER", "'ray'", "vllm-cli, api-server"]),
    ("unknown log level", DECODE, {"DLLM_LOG_LEVEL": "loud"},
     ["--log-level (or DLLM_LOG_LEVEL)", "'loud'", "DEBUG, INFO, WARNING, ERROR, CRITICAL"]),
]  # fmt: skip


def _changed(env: dict[str, str], changes: dict[str, str | None]) -> dict[str, str]:
    out = dict(env)
    for name, value in changes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def _assert_refused(
    result: subprocess.CompletedProcess[str], fake_vllm: FakeVllm, words: Sequence[str]
) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dllm-serve: ")
    for word in words:
        assert word in lines[0]
    assert result.stdout == ""
    assert not fake_vllm.started(), "vLLM was started despite the bad configuration"


@pytest.mark.parametrize(
    ("engine", "changes", "words"), [case[1:] for case in BAD_ENV], ids=[c[0] for c in BAD_ENV]
)
def test_bad_env_exits_2_naming_the_variable_and_never_starts_vllm(
    engine: str,
    changes: dict[str, str | None],
    words: list[str],
    request: pytest.FixtureRequest,
    run_serve: RunServe,
    fake_vllm: FakeVllm,
) -> None:
    seed: Engine = request.getfixturevalue(engine)
    env = _changed({**seed.env, "DLLM_SERVE_LAUNCHER": "vllm-cli"}, changes)
    result = run_serve(["--", *seed.args], env, fake_vllm)
    _assert_refused(result, fake_vllm, words)


def test_the_same_env_without_the_fault_does_start_vllm(
    seed_decode: Engine, run_serve: RunServe, fake_vllm: FakeVllm
) -> None:
    """The control for the refusals above: the double does record a start when the env is good."""
    result = run_serve(
        ["--", *seed_decode.args], {**seed_decode.env, "DLLM_SERVE_LAUNCHER": "vllm-cli"}, fake_vllm
    )
    assert result.returncode == 0, result.stderr
    assert fake_vllm.started()


@pytest.mark.parametrize(
    "own_flag",
    [
        ["--kv-transfer-config", '{"kv_role":"kv_both"}'],
        ['--kv-transfer-config={"kv_role":"kv_both"}'],
        ["--kv_transfer_config", "{}"],
        ["--kv-transfer-config.kv_role", "kv_both"],
        ["--kv-transfer", "{}"],
    ],
    ids=["spaced", "equals", "underscores", "dotted", "abbreviated"],
)
def test_engine_args_may_not_carry_their_own_kv_transfer_config(
    own_flag: list[str], seed_decode: Engine, run_serve: RunServe, fake_vllm: FakeVllm
) -> None:
    env = {**seed_decode.env, "DLLM_SERVE_LAUNCHER": "vllm-cli"}
    result = run_serve(["--", "--model", "m", *own_flag], env, fake_vllm)
    _assert_refused(result, fake_vllm, ["engine args", "--kv-transfer-config", "VLLM_KV_"])


def test_other_kv_flags_are_passed_through(seed_decode: Engine, run_serve: RunServe) -> None:
    args = ["--kv-cache-dtype", "fp8", "--kv-events-config", "{}"]
    result = run_serve(["--print", "--", *args], seed_decode.env)
    assert result.returncode == 0, result.stderr
    assert " --kv-cache-dtype fp8 --kv-events-config '{}' --middleware " in result.stdout


def test_engine_args_without_the_separator_are_refused(
    seed_decode: Engine, run_serve: RunServe, fake_vllm: FakeVllm
) -> None:
    env = {**seed_decode.env, "DLLM_SERVE_LAUNCHER": "vllm-cli"}
    result = run_serve(["--model", "m"], env, fake_vllm)
    assert result.returncode == 2
    assert "unrecognized arguments: --model m" in result.stderr
    assert "engine args go after `--`" in result.stderr
    assert not fake_vllm.started()


def test_print_refuses_a_bad_env_the_same_way(seed_prefill: Engine, run_serve: RunServe) -> None:
    env = {**seed_prefill.env, "VLLM_KV_COMPRESSION": "int4"}
    result = run_serve(["--print", "--", *seed_prefill.args], env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == "dllm-serve: VLLM_KV_COMPRESSION: 'int4' must be one of none, fp8, int8\n"


def test_the_log_level_is_the_one_logging_scheme_s(seed_decode: Engine, run_serve: RunServe) -> None:
    """--log-level, else DLLM_LOG_LEVEL, else INFO (dllm_contract.logs), as for the operator and router."""
    argv = ["--print", "--", *seed_decode.args]
    assert " INFO dllm_connector.serve: " in run_serve(argv, seed_decode.env).stderr
    quiet = run_serve(argv, {**seed_decode.env, "DLLM_LOG_LEVEL": "warning"})
    assert (quiet.returncode, quiet.stderr) == (0, "")
    assert "--kv-transfer-config" in quiet.stdout
    flagged = run_serve(["--log-level", "Info", *argv], {**seed_decode.env, "DLLM_LOG_LEVEL": "warning"})
    assert " INFO dllm_connector.serve: " in flagged.stderr
    refused = run_serve(["--log-level", "loud", *argv], seed_decode.env)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.startswith("dllm-serve: --log-level (or DLLM_LOG_LEVEL): 'loud' is not one of")
