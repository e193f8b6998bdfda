"""The router's settings: flags, their DLLM_ROUTER_* environment twins, and the one model they fill.

`parse_config(argv, environ)` reads the flags (argparse: --help, unknown flags), takes each missing
one from its variable (a flag given on the command line wins; the log level, given neither, from the
DLLM_LOG_LEVEL every dllm process reads), and validates the strings once into the frozen `RouterConfig`
(pydantic, lax mode), whose fields give each flag its help and default. A bad value is a `ConfigError`
naming the flag and its variable. Pure: no I/O.

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

from dllm_contract.logs import (
    DEFAULT_LEVEL,
    ENV_LOG_LEVEL,
    LEVELS,
    LOG_LEVEL_FLAG,
    checked_level,
    chosen_level,
)
from dllm_contract.router_defaults import (
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_ANSWER_MB,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MEMORY_BUDGET_MB,
    DEFAULT_REQUEST_TIMEOUT_S,
    MOONCAKE_BOOTSTRAP_PORT,
)
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


# Numbers are parsed by pydantic (lax mode: the strings of flags and variables); these check the range in
# the words the error shows, and _naming_the_setting words a number that does not parse.


def _whole(lo: int, hi: int) -> AfterValidator:
    def check(n: int) -> int:
        if not lo <= n <= hi:
            raise ValueError(f"{n} is outside {lo}..{hi}")
        return n

    return AfterValidator(check)


def _seconds(*, zero: bool = False) -> AfterValidator:
    def check(s: float) -> float:
        if not (s >= 0 if zero else s > 0) or s == float("inf"):  # NaN fails the first test
            raise ValueError(f"must be {'>=' if zero else '>'} 0 and finite, got {s:g}")
        return s

    return AfterValidator(check)


# What a value that does not parse is, by pydantic's error type (every float setting is in seconds).
_NOT_PARSED = {
    "int_parsing": "is not an integer",
    "int_from_float": "is not an integer",
    "float_parsing": "is not a number of seconds",
}


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
    """Every setting of one router process. A bad value is reported by field, in this order; each
    field's description is its flag's help, which adds the default from here."""

    flow: Annotated[Flow, _one_of(FLOWS)] = Field(description="PD request protocol: " + " | ".join(FLOWS))
    log_level: Annotated[str, AfterValidator(checked_level)] = Field(  # the one logging scheme's check
        DEFAULT_LEVEL,
        description=f"{' | '.join(LEVELS)}, in any case (unset: {env_name(LOG_LEVEL_FLAG)}, "
        f"else {ENV_LOG_LEVEL})",
    )
    event_loop: Annotated[EventLoop, _one_of(EVENT_LOOPS)] = Field(
        "auto", description=" | ".join(EVENT_LOOPS) + "; auto: uvloop when it is installed, else asyncio"
    )
    prefill: Upstreams
    decode: Upstreams
    host: str = Field("0.0.0.0", description="listen address")
    port: Annotated[int, _whole(0, 65535)] = Field(
        DEFAULT_HTTP_PORT, description="listen port; 0: any free port, which the start line names"
    )
    decode_kv_port: Port = Field(DEFAULT_KV_PORT, description="decode engines' KV listen port, dllm flow")
    prefill_tp_size: Annotated[int, _whole(1, 1024)] = Field(1, description="prefill tensor-parallel size")
    decode_tp_size: Annotated[int, _whole(1, 1024)] = Field(1, description="decode tensor-parallel size")
    mooncake_bootstrap_port: Port = Field(
        MOONCAKE_BOOTSTRAP_PORT, description="prefill bootstrap server port, mooncake flow"
    )
    resolve_interval_s: Annotated[float, _seconds()] = Field(
        5.0, description="seconds between DNS re-resolutions"
    )
    health_interval_s: Annotated[float, _seconds()] = Field(
        5.0, description="seconds between health checks of each pod"
    )
    connect_timeout_s: Annotated[float, _seconds()] = Field(
        5.0, description="upstream connect and health-check timeout"
    )
    # A pod busy with streams on loaded cores answers its probe late, not never: one late answer taking
    # out the only decode pod refused every request for a health interval (issue 34's surge roll).
    health_timeouts: Annotated[int, _whole(1, 100)] = Field(
        3,
        description="health checks in a row that time out before a ready pod is taken out; a refused "
        "connection or an answer other than 200 (a draining engine) takes it out at once",
    )
    request_timeout_s: Annotated[float, _seconds()] = Field(
        DEFAULT_REQUEST_TIMEOUT_S, description="whole upstream request timeout, streams included"
    )
    retries: Annotated[int, _whole(0, 10)] = Field(
        1, description="extra attempts on another pod when no byte reached the client"
    )
    # H2: a body expands several times once parsed, against the pod's memory limit (the operator sizes it)
    max_body_mb: Annotated[int, _whole(1, 4096)] = Field(
        DEFAULT_MAX_BODY_MB, description="largest request body accepted, in MiB"
    )
    # NEW-1: the operator derives both from the pod's memory limit, as the body limit
    memory_budget_mb: Annotated[int, _whole(1, 1_048_576)] = Field(
        DEFAULT_MEMORY_BUDGET_MB,
        description="MiB of client bodies and engine answers held at once across all requests; past it, 503",
    )
    max_answer_mb: Annotated[int, _whole(1, 1_048_576)] = Field(
        DEFAULT_MAX_ANSWER_MB,
        description="MiB of engine answers one request may hold (within --memory-budget-mb); past it, 502",
    )
    max_prompts: Annotated[int, _whole(1, 4096)] = Field(  # each is a prefill/decode pair of calls
        64, description="most prompts in one completions request"
    )
    max_n: Annotated[int, _whole(1, 1024)] = Field(16, description="most choices per prompt, n and best_of")
    max_logprobs: Annotated[int, _whole(0, 1024)] = Field(
        20,
        description="most logprobs per token (logprobs, top_logprobs, prompt_logprobs); a request's "
        "prompts and choices together may ask no more than one prompt may",
    )
    max_connections: Annotated[int, _whole(1, 1_000_000)] = Field(
        1024,
        description="most open client connections; a new one takes the slot of the longest idle one, "
        "and gets 503 when every one has a request in progress",
    )
    first_byte_timeout_s: Annotated[float, _seconds()] | None = Field(
        None, description="seconds a new connection may stay silent; unset or longer: --head-timeout-s"
    )
    head_timeout_s: Annotated[float, _seconds()] = Field(
        10.0, description="seconds a request head may take from its first byte"
    )
    body_timeout_s: Annotated[float, _seconds()] = Field(
        60.0, description="seconds a request body may take after its head"
    )
    # the operator derives it: the pod's grace period minus its preStop sleep
    drain_seconds: Annotated[float, _seconds(zero=True)] = Field(
        25.0, description="seconds in-flight requests get after SIGTERM"
    )
    kv_check_interval_s: Annotated[float, _seconds(zero=True)] = Field(
        0.0, description="seconds between two KV checks of a prefill/decode pair, dllm flow (0: no checks)"
    )
    kv_check_rdma: bool = Field(
        False, description="the KV check expects RDMA: KV over TCP is RDMAFallbackToTCP"
    )
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


# The flags that name a role's pods (RouterConfig.prefill and .decode); none has a default.
_UPSTREAM_FLAGS: Mapping[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    role: (
        (f"--{role}-dns", {"metavar": "HOST:PORT", "help": f"{role} headless Service and engine HTTP port"}),
        (
            f"--{role}-url",
            {"metavar": "URL", "action": "append", "help": f"static {role} base URL (repeatable)"},
        ),
    )
    for role in ("prefill", "decode")
}
_NOT_FLAGS = ("engine_api_key",)  # a variable only (see the module's docstring)


def _shown(default: object) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def _parser() -> argparse.ArgumentParser:
    """One flag per RouterConfig field, in the model's order: its help is the field's description and
    the default the model's."""
    p = argparse.ArgumentParser(
        prog="dllm-router",
        allow_abbrev=False,
        description="OpenAI-compatible PD router: prefill then decode with KV-transfer parameters.",
        epilog=f"Every flag can also be set by {ENV_PREFIX}<FLAG> (e.g. {env_name('--prefill-dns')}); "
        "repeatable flags take a comma-separated list there. Flags win.",
    )
    for key, field in RouterConfig.model_fields.items():
        for flag, options in _UPSTREAM_FLAGS.get(key, ()):
            p.add_argument(flag, **options)
        if key in _UPSTREAM_FLAGS or key in _NOT_FLAGS:
            continue
        default = "" if field.is_required() else f" (default {_shown(field.default)})"
        p.add_argument("--" + key.replace("_", "-"), help=f"{field.description}{default}")
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
    if "log_level" not in values:  # the level every dllm process takes, named as they name it
        try:
            values["log_level"] = chosen_level(None, environ)
        except ValueError as bad:
            raise ConfigError(str(bad)) from None
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
    elif problem["type"] in _NOT_PARSED:
        message = f"{problem['input']!r} {_NOT_PARSED[problem['type']]}"
    return f"{where}: {message}"
