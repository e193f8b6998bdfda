"""The router's command line: flags, their DLLM_ROUTER_* environment twins, and validation.

Pure: `parse_config(argv, environ)` turns strings into a frozen `RouterConfig` or raises `ConfigError`
naming the flag (and its variable). A flag given on the command line wins over its variable.

The engines' API key is not a flag (a flag would show in the pod spec and in `ps`): it comes from
DLLM_ENGINE_API_KEY only, which the operator fills from a per-CR Secret.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from dllm_contract.kvconfig import DEFAULT_KV_PORT

Flow = Literal["dllm", "mooncake", "nixl"]
FLOWS: tuple[Flow, ...] = ("dllm", "mooncake", "nixl")
LOG_LEVELS = ("debug", "info", "warning", "error")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
ENV_PREFIX = "DLLM_ROUTER_"
ENGINE_API_KEY_ENV = "DLLM_ENGINE_API_KEY"
Address = tuple[str, int]


class ConfigError(ValueError):
    """A flag or variable with a bad value; the message names both."""


@dataclass(frozen=True)
class Upstreams:
    """Where one role's pods are: a headless Service (re-resolved) or a static list of base URLs."""

    dns: Address | None = None
    urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class RouterConfig:
    flow: Flow
    prefill: Upstreams
    decode: Upstreams
    host: str = "0.0.0.0"
    port: int = 8000
    decode_kv_port: int = DEFAULT_KV_PORT
    prefill_tp_size: int = 1
    decode_tp_size: int = 1
    mooncake_bootstrap_port: int = 8998
    resolve_interval_s: float = 5.0
    health_interval_s: float = 5.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    retries: int = 1
    max_body_mb: int = 8  # H2: a body expands 5-25x when parsed; the pod's limit is 1 GiB
    max_prompts: int = 64  # prompts per completions request (each is two upstream calls)
    max_n: int = 16  # choices per prompt (n, best_of)
    max_connections: int = 1024  # client connections; above, 503 and close
    head_timeout_s: float = 10.0  # a request head must arrive within this from its first byte
    body_timeout_s: float = 60.0  # a request body must arrive within this from the end of its head
    drain_seconds: float = 25.0  # in-flight requests' time after SIGTERM (grace period minus preStop)
    log_level: str = "info"
    event_loop: str = "auto"  # uvloop when it is installed, else asyncio
    # sent as `Authorization: Bearer` on every engine call instead of the client's; never shown
    engine_api_key: str | None = field(default=None, repr=False)


def env_name(flag: str) -> str:
    """`--prefill-dns` -> `DLLM_ROUTER_PREFILL_DNS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


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
    add("--log-level", help="debug | info | warning | error (default info)")
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


def _where(key: str) -> str:
    flag = "--" + key.replace("_", "-")
    return f"{flag} (or {env_name(flag)})"


def _int(values: Mapping[str, object], key: str, default: int, lo: int, hi: int) -> int:
    raw = values.get(key)
    if raw is None:
        return default
    try:
        n = int(str(raw))
    except ValueError:
        raise ConfigError(f"{_where(key)}: {raw!r} is not an integer") from None
    if not lo <= n <= hi:
        raise ConfigError(f"{_where(key)}: {n} is outside {lo}..{hi}")
    return n


def _seconds(values: Mapping[str, object], key: str, default: float, zero: bool = False) -> float:
    raw = values.get(key)
    if raw is None:
        return default
    try:
        s = float(str(raw))
    except ValueError:
        raise ConfigError(f"{_where(key)}: {raw!r} is not a number of seconds") from None
    if not (s >= 0 if zero else s > 0) or s == float("inf"):
        raise ConfigError(f"{_where(key)}: must be {'>=' if zero else '>'} 0 and finite, got {raw!r}")
    return s


def engine_api_key(environ: Mapping[str, str]) -> str | None:
    """The engines' key from DLLM_ENGINE_API_KEY; empty means none. The error never quotes it."""
    key = environ.get(ENGINE_API_KEY_ENV, "").strip()
    if not key:
        return None
    if not key.isascii() or not key.isprintable():
        raise ConfigError(f"{ENGINE_API_KEY_ENV}: must be printable ASCII (it goes into a header)")
    return key


def parse_dns_target(key: str, raw: str) -> Address:
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{_where(key)}: {raw!r} is not HOST:PORT (e.g. llm-prefill:8000)")
    return host.strip("[]"), int(port)


def parse_base_url(key: str, raw: str) -> str:
    parts = urlsplit(raw)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ConfigError(f"{_where(key)}: {raw!r} is not a base URL like http://10.0.0.5:8000")
    if parts.path.strip("/") or parts.query:
        raise ConfigError(f"{_where(key)}: {raw!r} must have no path (the router adds /v1/...)")
    return f"{parts.scheme}://{parts.netloc}"


def _upstreams(values: Mapping[str, object], role: str) -> Upstreams:
    dns, urls = values.get(f"{role}_dns"), values.get(f"{role}_url")
    if dns is not None and urls:
        raise ConfigError(f"{role}: give either {_where(role + '_dns')} or {_where(role + '_url')}, not both")
    if dns is not None:
        return Upstreams(dns=parse_dns_target(f"{role}_dns", str(dns)))
    if urls:
        assert isinstance(urls, list)
        return Upstreams(urls=tuple(parse_base_url(f"{role}_url", str(u)) for u in urls))
    raise ConfigError(f"{role}: no pods configured; set {_where(role + '_dns')} or {_where(role + '_url')}")


def parse_config(argv: Sequence[str], environ: Mapping[str, str]) -> RouterConfig:
    values = _raw_values(argv, environ)
    flow = str(values.get("flow", ""))
    if flow not in FLOWS:
        raise ConfigError(f"{_where('flow')}: {flow!r} is not one of {', '.join(FLOWS)}")
    level = str(values.get("log_level", "info")).lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{_where('log_level')}: {level!r} is not one of {', '.join(LOG_LEVELS)}")
    event_loop = str(values.get("event_loop", "auto"))
    if event_loop not in EVENT_LOOPS:
        raise ConfigError(f"{_where('event_loop')}: {event_loop!r} is not one of {', '.join(EVENT_LOOPS)}")
    port_range = (1, 65535)
    return RouterConfig(
        flow=flow,
        prefill=_upstreams(values, "prefill"),
        decode=_upstreams(values, "decode"),
        host=str(values.get("host", "0.0.0.0")),
        port=_int(values, "port", 8000, 0, 65535),  # 0: any free port (the start line names it)
        decode_kv_port=_int(values, "decode_kv_port", DEFAULT_KV_PORT, *port_range),
        prefill_tp_size=_int(values, "prefill_tp_size", 1, 1, 1024),
        decode_tp_size=_int(values, "decode_tp_size", 1, 1, 1024),
        mooncake_bootstrap_port=_int(values, "mooncake_bootstrap_port", 8998, *port_range),
        resolve_interval_s=_seconds(values, "resolve_interval_s", 5.0),
        health_interval_s=_seconds(values, "health_interval_s", 5.0),
        connect_timeout_s=_seconds(values, "connect_timeout_s", 5.0),
        request_timeout_s=_seconds(values, "request_timeout_s", 600.0),
        retries=_int(values, "retries", 1, 0, 10),
        max_body_mb=_int(values, "max_body_mb", 8, 1, 4096),
        max_prompts=_int(values, "max_prompts", 64, 1, 4096),
        max_n=_int(values, "max_n", 16, 1, 1024),
        max_connections=_int(values, "max_connections", 1024, 1, 1_000_000),
        head_timeout_s=_seconds(values, "head_timeout_s", 10.0),
        body_timeout_s=_seconds(values, "body_timeout_s", 60.0),
        drain_seconds=_seconds(values, "drain_seconds", 25.0, zero=True),
        log_level=level,
        event_loop=event_loop,
        engine_api_key=engine_api_key(environ),
    )
