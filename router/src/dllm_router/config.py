"""The router's settings: flags, their DLLM_ROUTER_* environment twins, and the one model they fill.

`parse_config(argv, environ)` reads the flags (argparse: --help, unknown flags), takes each missing
one from its variable (a flag given on the command line wins), and validates the strings once into the
frozen `RouterConfig` (pydantic, lax mode). A bad value is a `ConfigError` naming the flag and its
variable. Pure: no I/O.

The engines' API key is not a flag (a flag would show in the pod spec and in `ps`): it comes from
DLLM_ENGINE_API_KEY only, which the operator fills from a per-CR Secret.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from dllm_contract.logs import checked_level
from dllm_contract.settings import DEFAULT_KV_PORT

Flow = Literal["dllm", "mooncake", "nixl"]
FLOWS: tuple[Flow, ...] = ("dllm", "mooncake", "nixl")
EventLoop = Literal["auto", "asyncio", "uvloop"]
EVENT_LOOPS: tuple[EventLoop, ...] = ("auto", "asyncio", "uvloop")
ENV_PREFIX = "DLLM_ROUTER_"
ENGINE_API_KEY_ENV = "DLLM_ENGINE_API_KEY"
Address = tuple[str, int]
COMMAND_LINE = "command_line"  # validation context: the values come from flags and variables


class ConfigError(ValueError):
    """A flag or variable with a bad value; the message names both."""


def env_name(flag: str) -> str:
    """`--prefill-dns` -> `DLLM_ROUTER_PREFILL_DNS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _where(key: str) -> str:
    """How an error names a setting: its flag and its variable."""
    flag = "--" + key.replace("_", "-")
    return f"{flag} (or {env_name(flag)})"


# ---- what each kind of value allows (the validators raise in the words the error shows) ----


def _one_of(choices: Sequence[str]) -> BeforeValidator:
    def check(value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return BeforeValidator(check)


def _whole(lo: int, hi: int) -> BeforeValidator:
    def check(raw: Any) -> int:
        try:
            n = int(str(raw))
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
        if not lo <= n <= hi:
            raise ValueError(f"{n} is outside {lo}..{hi}")
        return n

    return BeforeValidator(check)


def _seconds(*, zero: bool = False) -> BeforeValidator:
    def check(raw: Any) -> float:
        try:
            s = float(str(raw))
        except ValueError:
            raise ValueError(f"{raw!r} is not a number of seconds") from None
        if not (s >= 0 if zero else s > 0) or s == float("inf"):
            raise ValueError(f"must be {'>=' if zero else '>'} 0 and finite, got {raw!r}")
        return s

    return BeforeValidator(check)


def _dns_target(raw: Any) -> Any:
    """HOST:PORT (an IPv6 host in brackets) as (host, port); a pair passes as it is."""
    if not isinstance(raw, str):
        return raw
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{raw!r} is not HOST:PORT (e.g. llm-prefill:8000)")
    return host.strip("[]"), int(port)


def _base_url(raw: Any) -> Any:
    """scheme://host:port, without a path (the router adds /v1/...)."""
    parts = urlsplit(str(raw))
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"{raw!r} is not a base URL like http://10.0.0.5:8000")
    if parts.path.strip("/") or parts.query:
        raise ValueError(f"{raw!r} must have no path (the router adds /v1/...)")
    return f"{parts.scheme}://{parts.netloc}"


def _api_key(raw: Any) -> str | None:
    """Empty means none. The error never quotes the key."""
    key = str(raw or "").strip()
    if not key:
        return None
    if not key.isascii() or not key.isprintable():
        raise ValueError("must be printable ASCII (it goes into a header)")
    return key


Port = Annotated[int, _whole(1, 65535)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Upstreams(_Frozen):
    """Where one role's pods are: a headless Service (re-resolved) or a static list of base URLs."""

    dns: Annotated[tuple[str, int] | None, BeforeValidator(_dns_target)] = None
    urls: tuple[Annotated[str, BeforeValidator(_base_url)], ...] = ()


class RouterConfig(_Frozen):
    """Every setting of one router process. A bad value is reported by field, in this order."""

    flow: Annotated[Flow, _one_of(FLOWS)]
    log_level: Annotated[str, AfterValidator(checked_level)] = "INFO"  # the one logging scheme's check
    event_loop: Annotated[EventLoop, _one_of(EVENT_LOOPS)] = "auto"  # uvloop when installed, else asyncio
    prefill: Upstreams
    decode: Upstreams
    host: str = "0.0.0.0"
    port: Annotated[int, _whole(0, 65535)] = 8000  # 0: any free port (the start line names it)
    decode_kv_port: Port = DEFAULT_KV_PORT
    prefill_tp_size: Annotated[int, _whole(1, 1024)] = 1
    decode_tp_size: Annotated[int, _whole(1, 1024)] = 1
    mooncake_bootstrap_port: Port = 8998
    resolve_interval_s: Annotated[float, _seconds()] = 5.0
    health_interval_s: Annotated[float, _seconds()] = 5.0
    connect_timeout_s: Annotated[float, _seconds()] = 5.0
    request_timeout_s: Annotated[float, _seconds()] = 600.0
    retries: Annotated[int, _whole(0, 10)] = 1
    # H2: a body expands 5-25x when parsed; the pod's limit is 1 GiB
    max_body_mb: Annotated[int, _whole(1, 4096)] = 8
    max_prompts: Annotated[int, _whole(1, 4096)] = 64  # prompts per completions request (two calls each)
    max_n: Annotated[int, _whole(1, 1024)] = 16  # choices per prompt (n, best_of)
    max_connections: Annotated[int, _whole(1, 1_000_000)] = 1024  # client connections; above, 503
    head_timeout_s: Annotated[float, _seconds()] = 10.0  # a request head, from its first byte
    body_timeout_s: Annotated[float, _seconds()] = 60.0  # a request body, from the end of its head
    # in-flight requests' time after SIGTERM (grace period minus preStop)
    drain_seconds: Annotated[float, _seconds(zero=True)] = 25.0
    # sent as `Authorization: Bearer` on every engine call instead of the client's; never shown
    engine_api_key: Annotated[str | None, BeforeValidator(_api_key)] = Field(None, repr=False)

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _one_source(cls, value: Any, info: ValidationInfo) -> Any:
        """At most one of a role's two ways to name its pods; on the command line, exactly one (a
        program that builds a RouterConfig may hand the Router its own address source instead)."""
        dns: object
        urls: object
        if isinstance(value, Upstreams):
            dns, urls = value.dns, value.urls
        elif isinstance(value, Mapping):
            dns, urls = value.get("dns"), value.get("urls")
        else:
            return value  # pydantic refuses it
        role = info.field_name
        both = f"{_where(f'{role}_dns')} or {_where(f'{role}_url')}"
        if dns is not None and urls:
            raise ValueError(f"give either {both}, not both")
        if dns is None and not urls and (info.context or {}).get(COMMAND_LINE):
            raise ValueError(f"no pods configured; set {both}")
        return value


# ---- the command line ----


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dllm-router",
        allow_abbrev=False,
        description="OpenAI-compatible PD router: prefill then decode with KV-transfer parameters.",
        epilog=f"Every flag can also be set by {ENV_PREFIX}<FLAG> (e.g. {env_name('--prefill-dns')}); "
        "repeatable flags take a comma-separated list there. Flags win.",
    )
    add = p.add_argument
    add("--host", help="listen address (default 0.0.0.0)")
    add("--port", help="listen port (default 8000)")
    add("--flow", help="PD request protocol: " + " | ".join(FLOWS))
    add("--prefill-dns", metavar="HOST:PORT", help="prefill headless Service and engine HTTP port")
    add("--prefill-url", action="append", metavar="URL", help="static prefill base URL (repeatable)")
    add("--decode-dns", metavar="HOST:PORT", help="decode headless Service and engine HTTP port")
    add("--decode-url", action="append", metavar="URL", help="static decode base URL (repeatable)")
    add("--decode-kv-port", help=f"decode engines' KV listen port, dllm flow (default {DEFAULT_KV_PORT})")
    add("--prefill-tp-size", help="prefill tensor-parallel size (default 1)")
    add("--decode-tp-size", help="decode tensor-parallel size (default 1)")
    add("--mooncake-bootstrap-port", help="prefill bootstrap server port, mooncake flow (default 8998)")
    add("--resolve-interval-s", help="seconds between DNS re-resolutions (default 5)")
    add("--health-interval-s", help="seconds between health checks of each pod (default 5)")
    add("--connect-timeout-s", help="upstream connect and health-check timeout (default 5)")
    add("--request-timeout-s", help="whole upstream request timeout, streams included (default 600)")
    add("--retries", help="extra attempts on another pod when no byte reached the client (default 1)")
    add("--max-body-mb", help="largest request body accepted, in MiB (default 8)")
    add("--max-prompts", help="most prompts in one completions request (default 64)")
    add("--max-n", help="most choices per prompt, n and best_of (default 16)")
    add("--max-connections", help="most open client connections; more get 503 (default 1024)")
    add("--head-timeout-s", help="seconds a request head may take from its first byte (default 10)")
    add("--body-timeout-s", help="seconds a request body may take after its head (default 60)")
    add("--drain-seconds", help="seconds in-flight requests get after SIGTERM (default 25)")
    add("--log-level", help="debug | info | warning | error | critical (default info)")
    add("--event-loop", help="auto | asyncio | uvloop (default auto: uvloop when it is installed)")
    return p


def _raw_values(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str | list[str]]:
    """Flags as strings, each missing one taken from its environment variable."""
    parsed = vars(_parser().parse_args(list(argv)))
    values: dict[str, str | list[str]] = {}
    for key, value in parsed.items():
        flag = "--" + key.replace("_", "-")
        if value is None and env_name(flag) in environ:
            raw = environ[env_name(flag)]
            value = [u for u in raw.replace(",", " ").split() if u] if key.endswith("_url") else raw
        if value is not None:
            values[key] = value
    return values


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> RouterConfig:
    """The flags, else their variables, as a RouterConfig; ConfigError naming the first bad one."""
    values: dict[str, Any] = _raw_values(argv, environ)
    values.setdefault("flow", "")  # missing: refused as a flow that is none of the three
    for role in ("prefill", "decode"):
        values[role] = {"dns": values.pop(f"{role}_dns", None), "urls": values.pop(f"{role}_url", ())}
    values["engine_api_key"] = environ.get(ENGINE_API_KEY_ENV)
    try:
        return RouterConfig.model_validate(values, context={COMMAND_LINE: True})
    except ValidationError as error:
        raise ConfigError(_naming_the_setting(error.errors()[0])) from None


def _naming_the_setting(problem: ErrorDetails) -> str:
    """`<flag> (or <variable>): <what is wrong>`, as users have always seen it."""
    loc = problem["loc"]
    field = str(loc[0]) if loc else ""
    if field in ("prefill", "decode"):
        where = _where(f"{field}_{'dns' if loc[1:2] == ('dns',) else 'url'}") if len(loc) > 1 else field
    elif field == "engine_api_key":
        where = ENGINE_API_KEY_ENV
    else:
        where = _where(field)
    message = problem["msg"]
    if problem["type"] == "value_error":  # raised here, already in the words the user sees
        message = message.removeprefix("Value error, ")
    return f"{where}: {message}"
