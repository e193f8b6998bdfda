"""DLLM_KV_AUTH_TOKEN and DLLM_KV_TRANSFER_PORTS in the env contract (H4, C2).

The token reaches vLLM only through the environment: never its command line (the kv-transfer-config
JSON is visible in `ps` and the pod spec), never a log line. The port range travels in the extra config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dllm_contract import kvconfig

if TYPE_CHECKING:
    from conftest import Engine

pytestmark = pytest.mark.timeout(60)

TOKEN = "0123456789abcdef" * 4  # 64 hex characters, as the operator's Secret holds

# TEST DOUBLE standing in for vLLM's `vllm` CLI: it records its argv and whether (not what) the
# token reached its environment, so the test can tell where the secret went.
_VLLM_DOUBLE = """#!{python}
import json, os, sys
with open(os.environ["FAKE_VLLM_MARKER"], "w") as out:
    json.dump({{"argv": sys.argv[1:], "token_ok": os.environ.get("DLLM_KV_AUTH_TOKEN") == {token!r}}}, out)
"""


def _serve(tmp_path: Path, env: dict[str, str], *own: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    program = bin_dir / "vllm"
    program.write_text(_VLLM_DOUBLE.format(python=sys.executable, token=TOKEN))
    program.chmod(0o755)
    marker = tmp_path / "started.json"
    full = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "FAKE_VLLM_MARKER": str(marker),
        "DLLM_SERVE_LAUNCHER": "vllm-cli",
        **env,
    }
    if "PYTHONPATH" in os.environ:
        full["PYTHONPATH"] = os.environ["PYTHONPATH"]
    result = subprocess.run(
        [sys.executable, "-m", "dllm_connector.serve", *own, "--", "--model", "m"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result, marker


def test_the_token_reaches_vllm_by_environment_only_and_is_never_logged(
    tmp_path: Path, seed_decode: Engine
) -> None:
    env = {**seed_decode.env, "DLLM_KV_AUTH_TOKEN": TOKEN, "DLLM_KV_TRANSFER_PORTS": "20000-20127"}
    result, marker = _serve(tmp_path, env)
    assert result.returncode == 0, result.stderr
    started = json.loads(marker.read_text())
    assert started["token_ok"]
    assert TOKEN not in " ".join(started["argv"])
    assert TOKEN not in result.stdout + result.stderr
    config = json.loads(started["argv"][started["argv"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["transfer_ports"] == [20000, 20127]
    assert "auth" not in json.dumps(config).lower()


def test_print_shows_no_token(tmp_path: Path, seed_prefill: Engine) -> None:
    result, _ = _serve(tmp_path, {**seed_prefill.env, "DLLM_KV_AUTH_TOKEN": TOKEN}, "--print")
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr


@pytest.mark.parametrize(("token", "shown"), [(TOKEN, "true"), (None, "false")])
def test_the_log_line_says_whether_the_side_channel_authenticates(
    tmp_path: Path, seed_prefill: Engine, token: str | None, shown: str
) -> None:
    env = dict(seed_prefill.env) if token is None else {**seed_prefill.env, "DLLM_KV_AUTH_TOKEN": token}
    result, _ = _serve(tmp_path, env, "--print")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stderr.splitlines() if "resolved configuration" in line)
    assert f'"kv_side_channel_authenticated":{shown}' in line


BAD = [
    ("short token", "DLLM_KV_AUTH_TOKEN", "secret-but-short", ["at least 32 characters", "has 16"]),
    ("blank-padded short token", "DLLM_KV_AUTH_TOKEN", "  " + "x" * 31 + "\n", ["at least 32"]),
    ("token with a control character", "DLLM_KV_AUTH_TOKEN", "x" * 32 + "\x07", ["printable ASCII"]),
    ("ports not a range", "DLLM_KV_TRANSFER_PORTS", "20000", ["'20000'", "LOW-HIGH"]),
    ("ports reversed", "DLLM_KV_TRANSFER_PORTS", "20010-20000", ["LOW <= HIGH"]),
    ("ports below 1024", "DLLM_KV_TRANSFER_PORTS", "80-90", ["1024"]),
    ("ports above 65535", "DLLM_KV_TRANSFER_PORTS", "65000-70000", ["65535"]),
    ("ports in the ephemeral range", "DLLM_KV_TRANSFER_PORTS", "40000-40127", ["32768-60999", "15000-17000"]),
    ("ports spanning the ephemeral range", "DLLM_KV_TRANSFER_PORTS", "30000-62000", ["32768-60999"]),
    ("one port only", "DLLM_KV_TRANSFER_PORTS", "20000-20000", ["at least 2 ports"]),
    ("ports with words", "DLLM_KV_TRANSFER_PORTS", "low-high", ["LOW-HIGH"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value", "words"), [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_a_bad_value_exits_2_naming_the_variable(
    tmp_path: Path, seed_decode: Engine, name: str, value: str, words: list[str]
) -> None:
    result, marker = _serve(tmp_path, {**seed_decode.env, name: value})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"dllm-serve: {name}: ")
    for word in words:
        assert word in lines[0]
    if name == "DLLM_KV_AUTH_TOKEN":
        assert value.strip() not in lines[0]  # a refused token is not echoed either
    assert not marker.exists(), "vLLM was started despite the bad configuration"


def test_both_names_are_reserved_for_the_operator() -> None:
    assert {"DLLM_KV_AUTH_TOKEN", "DLLM_KV_TRANSFER_PORTS"} <= set(kvconfig.CONTRACT_ENV_NAMES)


def test_the_port_range_round_trips_through_env_and_extra_config(seed_decode: Engine) -> None:
    settings = kvconfig.from_env({**seed_decode.env, "DLLM_KV_TRANSFER_PORTS": " 61000-61127 "})
    assert settings.transfer_ports == (61000, 61127)
    assert kvconfig.to_env(settings)["DLLM_KV_TRANSFER_PORTS"] == "61000-61127"
    extra = kvconfig.kv_transfer_config(settings, "e")["kv_connector_extra_config"]
    assert kvconfig.ConnectorExtraConfig.model_validate(extra).transfer_ports == (61000, 61127)
    without = kvconfig.kv_transfer_config(kvconfig.from_env(seed_decode.env), "e")
    assert "transfer_ports" not in without["kv_connector_extra_config"]  # unchanged JSON when unset


@pytest.mark.parametrize("ports", [[40000, 40010], [20010, 20000], [1, 2], [20000, 20000]])
def test_the_extra_config_refuses_a_port_range_mooncake_would_not_use(ports: list[int]) -> None:
    base = kvconfig.kv_transfer_config(
        kvconfig.KVTransferSettings(connector="mooncake", role="decode", listen_port=1, buffer_size_gb=1), "e"
    )["kv_connector_extra_config"]
    with pytest.raises(ValueError, match="transfer_ports"):
        kvconfig.ConnectorExtraConfig.model_validate({**base, "transfer_ports": ports})


def test_side_channel_token_gives_the_workers_key_or_none(seed_decode: Engine) -> None:
    from dllm_connector.transport.sidechannel import PeerAuth

    assert kvconfig.side_channel_token(seed_decode.env) is None
    assert kvconfig.side_channel_token({"DLLM_KV_AUTH_TOKEN": ""}) is None
    token = kvconfig.side_channel_token({"DLLM_KV_AUTH_TOKEN": TOKEN + "\n"})
    assert token is not None
    assert PeerAuth.from_token(token) == PeerAuth.from_token(TOKEN)
    with pytest.raises(kvconfig.EnvContractError) as refused:
        kvconfig.side_channel_token({"DLLM_KV_AUTH_TOKEN": "short"})
    assert refused.value.variable == "DLLM_KV_AUTH_TOKEN"
    assert "short" not in str(refused.value)


def test_kvconfig_imports_without_torch() -> None:
    """The operator imports kvconfig; torch is not in its image."""
    code = (
        "import sys; sys.modules['torch'] = None; import dllm_contract.kvconfig as k; "
        "print(k.ENV_KV_AUTH_TOKEN)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "DLLM_KV_AUTH_TOKEN"
