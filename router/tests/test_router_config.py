"""The dllm-router command line: flags, DLLM_ROUTER_* variables, and a clear error for each bad value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dllm_router.__main__ import main
from dllm_router.config import ConfigError, RouterConfig, Upstreams, env_name, parse_config

pytestmark = pytest.mark.timeout(10)

OPERATOR_ARGS = [
    "--host", "0.0.0.0", "--port", "8000", "--flow", "dllm",
    "--prefill-dns", "llm-prefill:8000", "--decode-dns", "llm-decode:8001",
    "--decode-kv-port", "50051", "--prefill-tp-size", "4", "--decode-tp-size", "2",
    "--resolve-interval-s", "5", "--health-interval-s", "5", "--connect-timeout-s", "5",
    "--request-timeout-s", "600", "--log-level", "info",
]  # fmt: skip


OPERATOR_SNAPSHOTS = sorted((Path(__file__).parents[2] / "operator" / "tests" / "snapshots").glob("*.yaml"))


def rendered_router_container(snapshot: Path) -> dict[str, Any]:
    for manifest in yaml.safe_load_all(snapshot.read_text()):
        if manifest and manifest["kind"] == "Deployment":
            for container in manifest["spec"]["template"]["spec"]["containers"]:
                if container["command"] == ["dllm-router"]:
                    return dict(container)
    raise AssertionError(f"{snapshot.name} renders no dllm-router container")


@pytest.mark.parametrize("snapshot", OPERATOR_SNAPSHOTS, ids=lambda p: p.stem)
def test_the_operator_s_rendered_router_args_parse(snapshot: Path) -> None:
    """test-review section 2: the flags the operator renders (its snapshots, which its own tests keep
    equal to its rendering) are the flags dllm-router takes, so a flag renamed on one side fails here."""
    container = rendered_router_container(snapshot)
    env = {"DLLM_ENGINE_API_KEY": "a-key-from-the-secret"}  # the one variable it renders, from a Secret
    assert {e["name"] for e in container.get("env", [])} <= set(env)
    args = [str(a) for a in container["args"]]
    config = parse_config(args, env)
    given = dict(zip(args[::2], args[1::2], strict=True))
    assert config.flow == given["--flow"]
    assert config.port == int(given["--port"])
    assert config.prefill.dns is not None
    assert config.decode.dns is not None
    assert f"{config.prefill.dns[0]}:{config.prefill.dns[1]}" == given["--prefill-dns"]
    assert f"{config.decode.dns[0]}:{config.decode.dns[1]}" == given["--decode-dns"]
    assert config.engine_api_key == "a-key-from-the-secret"


def test_the_operator_s_snapshots_are_found() -> None:
    """Else the test above would have no cases and pass by skipping."""
    assert len(OPERATOR_SNAPSHOTS) >= 5


def test_operator_command_line_parses() -> None:
    config = parse_config(OPERATOR_ARGS, {})
    assert config == RouterConfig(
        flow="dllm",
        prefill=Upstreams(dns=("llm-prefill", 8000)),
        decode=Upstreams(dns=("llm-decode", 8001)),
        prefill_tp_size=4,
        decode_tp_size=2,
    )
    assert config.event_loop == "auto"  # uvloop when installed


def test_static_urls_repeat_and_variables_fill_missing_flags() -> None:
    env = {
        "DLLM_ROUTER_FLOW": "mooncake",
        "DLLM_ROUTER_PREFILL_URL": "http://10.0.0.1:8000, http://10.0.0.2:8000",
        "DLLM_ROUTER_DECODE_URL": "http://10.0.0.3:8001",
        "DLLM_ROUTER_MOONCAKE_BOOTSTRAP_PORT": "8998",
        "DLLM_ROUTER_PORT": "9000",
    }
    config = parse_config(
        ["--port", "9100", "--decode-url", "http://d:1", "--decode-url", "http://e:2/"], env
    )
    assert config.flow == "mooncake"
    assert config.prefill.urls == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert config.decode.urls == ("http://d:1", "http://e:2")  # the flags win over the variable
    assert config.port == 9100
    assert config.mooncake_bootstrap_port == 8998


def test_env_names() -> None:
    assert env_name("--prefill-dns") == "DLLM_ROUTER_PREFILL_DNS"
    assert env_name("--request-timeout-s") == "DLLM_ROUTER_REQUEST_TIMEOUT_S"


BASE = ["--flow", "nixl", "--prefill-url", "http://p:8000", "--decode-url", "http://d:8000"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ["--flow", "auto", *BASE[2:]],
            {},
            "--flow (or DLLM_ROUTER_FLOW): 'auto' is not one of dllm, mooncake",
        ),
        (BASE[2:], {}, "--flow (or DLLM_ROUTER_FLOW): '' is not one of"),
        (
            ["--flow", "dllm", "--decode-url", "http://d:1"],
            {},
            "prefill: no pods configured; set --prefill-dns",
        ),
        ([*BASE, "--prefill-dns", "p:8000"], {}, "prefill: give either --prefill-dns"),
        (["--flow", "dllm", "--prefill-dns", "nope", "--decode-url", "http://d:1"], {}, "is not HOST:PORT"),
        (
            ["--flow", "dllm", "--prefill-dns", "p:0", "--decode-url", "http://d:1"],
            {},
            "'p:0' is not HOST:PORT",
        ),
        (
            ["--flow", "dllm", "--prefill-url", "p:8000", "--decode-url", "http://d:1"],
            {},
            "is not a base URL",
        ),
        (
            ["--flow", "dllm", "--prefill-url", "http://p", "--decode-url", "http://d:1"],
            {},
            "is not a base URL",
        ),
        (
            ["--flow", "dllm", "--prefill-url", "http://p:1/v1", "--decode-url", "http://d:1"],
            {},
            "must have no path",
        ),
        ([*BASE, "--port", "70000"], {}, "--port (or DLLM_ROUTER_PORT): 70000 is outside 0..65535"),
        (
            [*BASE, "--decode-kv-port", "x"],
            {},
            "--decode-kv-port (or DLLM_ROUTER_DECODE_KV_PORT): 'x' is not an",
        ),
        (
            [*BASE, "--decode-tp-size", "0"],
            {},
            "--decode-tp-size (or DLLM_ROUTER_DECODE_TP_SIZE): 0 is outside",
        ),
        (
            BASE,
            {"DLLM_ROUTER_HEALTH_INTERVAL_S": "-1"},
            "--health-interval-s (or DLLM_ROUTER_HEALTH_INTERVAL_S)",
        ),
        ([*BASE, "--request-timeout-s", "soon"], {}, "'soon' is not a number of seconds"),
        ([*BASE, "--log-level", "loud"], {}, "--log-level (or DLLM_ROUTER_LOG_LEVEL): 'loud' is not one of"),
        (
            [*BASE, "--event-loop", "trio"],
            {},
            "--event-loop (or DLLM_ROUTER_EVENT_LOOP): 'trio' is not one of",
        ),
        (
            [*BASE, "--max-body-mb", "0"],
            {},
            "--max-body-mb (or DLLM_ROUTER_MAX_BODY_MB): 0 is outside 1..4096",
        ),
    ],
)
def test_bad_values_are_refused_naming_flag_and_variable(
    args: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(args, env)
    assert message in str(refused.value)


def test_main_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--flow", "auto", *BASE[2:]]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dllm-router: --flow (or DLLM_ROUTER_FLOW): 'auto' is not one of dllm, mooncake, nixl"


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--prefil-url", "http://p:1"], {})
    assert exited.value.code == 2
    assert "unrecognized arguments: --prefil-url" in capsys.readouterr().err


def test_hardening_flags_default_and_take_their_variables() -> None:
    """H2, M1, M4: the operator renders these flags (or their DLLM_ROUTER_* twins)."""
    config = parse_config(BASE, {})
    assert (config.max_body_mb, config.max_prompts, config.max_n) == (8, 64, 16)
    assert (config.max_connections, config.head_timeout_s, config.body_timeout_s) == (1024, 10.0, 60.0)
    assert config.drain_seconds == 25.0
    assert config.engine_api_key is None
    assert config.first_byte_timeout_s is None  # NEW-5: the HTTP server then uses the head deadline
    args = [*BASE, "--max-prompts", "3", "--max-n", "2", "--max-connections", "10", "--drain-seconds", "0"]
    env = {
        "DLLM_ROUTER_MAX_BODY_MB": "2",
        "DLLM_ROUTER_HEAD_TIMEOUT_S": "1.5",
        "DLLM_ROUTER_BODY_TIMEOUT_S": "7",
        "DLLM_ROUTER_DRAIN_SECONDS": "55",
        "DLLM_ROUTER_MAX_N": "9",
        "DLLM_ROUTER_FIRST_BYTE_TIMEOUT_S": "0.5",
    }
    config = parse_config(args, env)
    assert config.first_byte_timeout_s == 0.5
    assert (config.max_body_mb, config.max_prompts, config.max_n) == (2, 3, 2)  # flags win
    assert (config.max_connections, config.head_timeout_s, config.body_timeout_s) == (10, 1.5, 7.0)
    assert config.drain_seconds == 0.0  # a grace period of 5 s leaves none after the preStop sleep
    assert parse_config(BASE, {"DLLM_ROUTER_DRAIN_SECONDS": "55"}).drain_seconds == 55.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-prompts", "0"], "--max-prompts (or DLLM_ROUTER_MAX_PROMPTS): 0 is outside"),
        (["--max-n", "x"], "--max-n (or DLLM_ROUTER_MAX_N): 'x' is not an integer"),
        (["--max-connections", "0"], "--max-connections (or DLLM_ROUTER_MAX_CONNECTIONS): 0 is outside"),
        (["--head-timeout-s", "0"], "--head-timeout-s (or DLLM_ROUTER_HEAD_TIMEOUT_S): must be > 0"),
        (["--body-timeout-s", "inf"], "--body-timeout-s (or DLLM_ROUTER_BODY_TIMEOUT_S): must be > 0"),
        (["--drain-seconds", "-1"], "--drain-seconds (or DLLM_ROUTER_DRAIN_SECONDS): must be >= 0"),
    ],
)
def test_bad_hardening_values_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config([*BASE, *args], {})
    assert message in str(refused.value)


def test_engine_api_key_comes_from_its_variable_and_never_shows() -> None:
    key = "k3y-from-a-secret"
    config = parse_config(BASE, {"DLLM_ENGINE_API_KEY": f" {key}\n"})
    assert config.engine_api_key == key
    assert key not in repr(config)
    assert parse_config(BASE, {"DLLM_ENGINE_API_KEY": ""}).engine_api_key is None
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE, {"DLLM_ENGINE_API_KEY": "abc\r\nX-Injected: 1"})
    assert "DLLM_ENGINE_API_KEY: must be printable ASCII" in str(refused.value)
    assert "abc" not in str(refused.value)


def test_log_level_is_the_one_logging_scheme_s() -> None:
    """The level is checked by dllm_contract.logs, as the operator's and dllm-serve's are: any case."""
    assert parse_config([*BASE, "--log-level", "Debug"], {}).log_level == "DEBUG"
    assert parse_config(BASE, {"DLLM_ROUTER_LOG_LEVEL": "critical"}).log_level == "CRITICAL"
    assert parse_config(BASE, {}).log_level == "INFO"


def test_a_config_built_in_code_is_validated_as_the_command_line_is() -> None:
    """One model: a program building RouterConfig gets the same checks (it may leave a role's pods to
    an address source it hands the Router, but not name them two ways)."""
    with pytest.raises(ValueError, match=r"0 is outside 1\.\.1024"):
        RouterConfig(flow="dllm", prefill=Upstreams(), decode=Upstreams(), decode_tp_size=0)
    with pytest.raises(ValueError, match="give either --decode-dns"):
        RouterConfig(flow="dllm", prefill=Upstreams(), decode=Upstreams(dns=("d", 1), urls=("http://d:1",)))
    with pytest.raises(ValueError, match="frozen"):
        parse_config(BASE, {}).port = 1  # type: ignore[misc]


def test_help_shows_each_flag_with_the_model_s_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Each default is written once, in RouterConfig: --help and the parsed config both take it."""
    with pytest.raises(SystemExit):
        parse_config(["--help"], {})
    shown = " ".join(capsys.readouterr().out.split())
    defaults = parse_config(BASE, {})
    for key, field in RouterConfig.model_fields.items():
        if field.is_required() or key == "engine_api_key":
            continue
        default = field.default
        text = f"{default:g}" if isinstance(default, float) else str(default)
        assert f"--{key.replace('_', '-')} " in shown
        assert f"{field.description} (default {text})" in shown, key
        assert getattr(defaults, key) == default, key
    for flag in ("--flow", "--prefill-dns", "--prefill-url", "--decode-dns", "--decode-url"):
        assert flag in shown
    assert "--engine-api-key" not in shown


def test_the_level_every_dllm_process_takes_is_the_last_resort() -> None:
    """--log-level, else DLLM_ROUTER_LOG_LEVEL, else DLLM_LOG_LEVEL (the operator's and dllm-serve's)."""
    assert parse_config(BASE, {"DLLM_LOG_LEVEL": "warning"}).log_level == "WARNING"
    env = {"DLLM_LOG_LEVEL": "warning", "DLLM_ROUTER_LOG_LEVEL": "error"}
    assert parse_config(BASE, env).log_level == "ERROR"
    assert parse_config([*BASE, "--log-level", "debug"], env).log_level == "DEBUG"
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE, {"DLLM_LOG_LEVEL": "loud"})
    assert str(refused.value).startswith("--log-level (or DLLM_LOG_LEVEL): 'loud' is not one of DEBUG")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DLLM_ROUTER_RETRIES": "1.5"}, "--retries (or DLLM_ROUTER_RETRIES): '1.5' is not an integer"),
        ({"DLLM_ROUTER_PORT": "0x10"}, "--port (or DLLM_ROUTER_PORT): '0x10' is not an integer"),
        ({"DLLM_ROUTER_CONNECT_TIMEOUT_S": "nan"}, "must be > 0 and finite, got nan"),
        (
            {"DLLM_ROUTER_HEAD_TIMEOUT_S": "inf"},
            "--head-timeout-s (or DLLM_ROUTER_HEAD_TIMEOUT_S): must be > 0",
        ),
        (
            {"DLLM_ROUTER_DRAIN_SECONDS": ""},
            "--drain-seconds (or DLLM_ROUTER_DRAIN_SECONDS): '' is not a number",
        ),
    ],
)
def test_a_number_from_a_variable_is_refused_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(BASE, env)
    assert message in str(refused.value)


def test_numbers_take_blanks_around_them() -> None:
    config = parse_config(BASE, {"DLLM_ROUTER_PORT": " 8001 ", "DLLM_ROUTER_BODY_TIMEOUT_S": " 2.5"})
    assert (config.port, config.body_timeout_s) == (8001, 2.5)
