"""The environment contract (api.md): the variables that carry KVTransferSettings into an engine pod.

`to_env` is what the operator writes; `from_env` is what `dllm-serve` reads back, parsed by pydantic into
the same model, so the two sides cannot drift. A bad variable is an EnvContractError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import (
    ValidationError,
)

from dllm_contract.settings import (
    DEFAULT_KV_PORT,
    Connector,
    CustomConnector,
    KVTransferSettings,
    Protocol,
    Role,
)

# The shortest DLLM_KV_AUTH_TOKEN (transport.sidechannel.PeerAuth checks the same).
MIN_TOKEN_CHARS = 32


class EnvContractError(ValueError):
    """One environment variable is missing or invalid; the message names it and what it allows."""

    def __init__(self, variable: str, reason: str) -> None:
        super().__init__(f"{variable}: {reason}")
        self.variable = variable


ENV_CONNECTOR = "VLLM_KV_CONNECTOR"
ENV_ROLE = "VLLM_KV_ROLE"
ENV_DECODE_IP = "VLLM_KV_DECODE_IP"
ENV_DECODE_PORT = "VLLM_KV_DECODE_PORT"
ENV_LISTEN_PORT = "VLLM_KV_LISTEN_PORT"
ENV_BUFFER_SIZE_GB = "VLLM_KV_BUFFER_SIZE_GB"
ENV_COMPRESSION = "VLLM_KV_COMPRESSION"
ENV_THRESHOLD = "VLLM_KV_TRANSFER_THRESHOLD"
ENV_TIMEOUT_MS = "VLLM_KV_TRANSFER_TIMEOUT_MS"
ENV_PREFILL_WAIT_MS = "VLLM_KV_PREFILL_WAIT_MS"
ENV_HOLD_SECONDS = "VLLM_KV_HOLD_SECONDS"
ENV_ASYNC = "VLLM_KV_ASYNC"
ENV_LOAD_FAILURE_POLICY = "VLLM_KV_LOAD_FAILURE_POLICY"
ENV_PROTOCOL = "MOONCAKE_PROTOCOL"
ENV_RDMA_DEVICE = "MOONCAKE_RDMA_DEVICE"
ENV_GID_INDEX = "MC_GID_INDEX"
ENV_HOST_IP = "VLLM_HOST_IP"
ENV_ENGINE_ID = "DLLM_ENGINE_ID"
# The side channel's shared key. Never part of the settings, the kv-transfer-config JSON (which is on
# vLLM's command line) or any log: the worker reads it from its own environment (worker).
ENV_KV_AUTH_TOKEN = "DLLM_KV_AUTH_TOKEN"  # noqa: S105 - an env name
# "LOW-HIGH": the ports Mooncake listens on, for NetworkPolicies and hostNetwork users.
ENV_TRANSFER_PORTS = "DLLM_KV_TRANSFER_PORTS"
# The other role's TP size: the only one a request may name for it.
ENV_PEER_TP_SIZE = "DLLM_KV_PEER_TP_SIZE"
# Not in the compose file: how a custom connector is named (api.md's kvTransfer.custom).
ENV_CUSTOM_CLASS = "VLLM_KV_CONNECTOR_CLASS"
ENV_CUSTOM_MODULE = "VLLM_KV_CONNECTOR_MODULE_PATH"
ENV_CUSTOM_EXTRA = "VLLM_KV_CONNECTOR_EXTRA_CONFIG"

# Every name the operator owns: a role's `env` may not set one of these.
CONTRACT_ENV_NAMES: tuple[str, ...] = (
    ENV_CONNECTOR,
    ENV_ROLE,
    ENV_DECODE_IP,
    ENV_DECODE_PORT,
    ENV_LISTEN_PORT,
    ENV_BUFFER_SIZE_GB,
    ENV_COMPRESSION,
    ENV_THRESHOLD,
    ENV_TIMEOUT_MS,
    ENV_PREFILL_WAIT_MS,
    ENV_HOLD_SECONDS,
    ENV_ASYNC,
    ENV_LOAD_FAILURE_POLICY,
    ENV_PROTOCOL,
    ENV_RDMA_DEVICE,
    ENV_GID_INDEX,
    ENV_HOST_IP,
    ENV_ENGINE_ID,
    ENV_KV_AUTH_TOKEN,
    ENV_TRANSFER_PORTS,
    ENV_PEER_TP_SIZE,
    ENV_CUSTOM_CLASS,
    ENV_CUSTOM_MODULE,
    ENV_CUSTOM_EXTRA,
)

# Filled from the pod itself (downward API), not from the spec.
DOWNWARD_API_ENV: Mapping[str, str] = {ENV_HOST_IP: "status.podIP", ENV_ENGINE_ID: "metadata.name"}


def _format_bool(value: bool) -> str:
    return "true" if value else "false"


def _format_float(value: float) -> str:
    return repr(float(value)).removesuffix(".0") if float(value).is_integer() else repr(value)


def _format_ports(ports: tuple[int, int] | None) -> str | None:
    return None if ports is None else f"{ports[0]}-{ports[1]}"


def to_env(settings: KVTransferSettings) -> dict[str, str]:
    """The env an engine container gets, in api.md's table order; unset optionals are left out."""
    env: dict[str, str | None] = {
        ENV_CONNECTOR: settings.connector.value,
        ENV_ROLE: settings.role.value,
        ENV_DECODE_IP: settings.decode_host,
        ENV_DECODE_PORT: None if settings.decode_port is None else str(settings.decode_port),
        ENV_LISTEN_PORT: str(settings.listen_port),
        ENV_BUFFER_SIZE_GB: _format_float(settings.buffer_size_gb),
        ENV_COMPRESSION: settings.compression.value,
        ENV_THRESHOLD: str(settings.transfer_threshold_tokens),
        ENV_TIMEOUT_MS: str(settings.transfer_timeout_ms),
        ENV_PREFILL_WAIT_MS: None if settings.prefill_wait_ms is None else str(settings.prefill_wait_ms),
        ENV_HOLD_SECONDS: None if settings.hold_seconds is None else str(settings.hold_seconds),
        ENV_ASYNC: _format_bool(settings.async_transfer),
        ENV_LOAD_FAILURE_POLICY: settings.load_failure_policy.value,
        ENV_PROTOCOL: settings.protocol.value,
        ENV_RDMA_DEVICE: ",".join(settings.rdma_devices) or None,
        ENV_GID_INDEX: None if settings.gid_index is None else str(settings.gid_index),
        ENV_HOST_IP: settings.host_ip,
        ENV_ENGINE_ID: settings.engine_id,
        ENV_TRANSFER_PORTS: _format_ports(settings.transfer_ports),
        ENV_PEER_TP_SIZE: None if settings.peer_tp_size is None else str(settings.peer_tp_size),
    }
    if settings.custom is not None:
        env[ENV_CUSTOM_CLASS] = settings.custom.connector_class
        env[ENV_CUSTOM_MODULE] = settings.custom.module_path
        env[ENV_CUSTOM_EXTRA] = json.dumps(settings.custom.extra_config, sort_keys=True) or None
    return {name: value for name, value in env.items() if value is not None}


# variable -> settings field, in the order a bad variable is reported (the first one wins).
ENV_FIELDS: Mapping[str, str] = {
    ENV_CONNECTOR: "connector",
    ENV_ROLE: "role",
    ENV_LISTEN_PORT: "listen_port",
    ENV_DECODE_IP: "decode_host",
    ENV_DECODE_PORT: "decode_port",
    ENV_BUFFER_SIZE_GB: "buffer_size_gb",
    ENV_COMPRESSION: "compression",
    ENV_THRESHOLD: "transfer_threshold_tokens",
    ENV_TIMEOUT_MS: "transfer_timeout_ms",
    ENV_PREFILL_WAIT_MS: "prefill_wait_ms",
    ENV_HOLD_SECONDS: "hold_seconds",
    ENV_ASYNC: "async_transfer",
    ENV_LOAD_FAILURE_POLICY: "load_failure_policy",
    ENV_PROTOCOL: "protocol",
    ENV_RDMA_DEVICE: "rdma_devices",
    ENV_GID_INDEX: "gid_index",
    ENV_HOST_IP: "host_ip",
    ENV_ENGINE_ID: "engine_id",
    ENV_TRANSFER_PORTS: "transfer_ports",
    ENV_PEER_TP_SIZE: "peer_tp_size",
}
_VARIABLE = {field: name for name, field in ENV_FIELDS.items()}
_ORDER = {field: index for index, field in enumerate(ENV_FIELDS.values())}
_REQUIRED_ENV = (ENV_CONNECTOR, ENV_ROLE)

# The seed's compose file runs Mooncake as a service of its own, configured by MOONCAKE_RDMA_DEVICE
# and this; the engine embeds Mooncake here, so an engine given the service's settings takes them.
ENV_MOONCAKE_BUFFER_SIZE = "MOONCAKE_BUFFER_SIZE"
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _json_object(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError("must be a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")  # noqa: TRY004 (reported as a bad value, like the others)
    return value


def _size_gb(raw: str) -> float:
    """MOONCAKE_BUFFER_SIZE ("16G", "512M", "16GiB" or bytes) in the contract's GB (2^30 bytes)."""
    text = raw.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text[-1:] in _SIZE_UNITS else (text, "")
    try:
        size = float(number) * _SIZE_UNITS[unit] / _SIZE_UNITS["G"]
    except ValueError:
        raise ValueError("must be a size such as 16G, 512M or a number of bytes") from None
    if not 0 < size < float("inf"):
        raise ValueError("must be a size greater than 0, such as 16G")
    return size


def _parse_custom(env: Mapping[str, str]) -> CustomConnector | None:
    if env.get(ENV_CONNECTOR, "").strip().lower() != Connector.CUSTOM.value:
        return None
    connector_class = env.get(ENV_CUSTOM_CLASS, "").strip()
    if not connector_class:
        raise EnvContractError(
            ENV_CUSTOM_CLASS, "required when VLLM_KV_CONNECTOR=custom: a connector class name"
        )
    extra: dict[str, Any] = {}
    if env.get(ENV_CUSTOM_EXTRA):
        try:
            extra = _json_object(env[ENV_CUSTOM_EXTRA])
        except ValueError as error:
            raise EnvContractError(ENV_CUSTOM_EXTRA, str(error)) from None
    module = env.get(ENV_CUSTOM_MODULE, "").strip() or None
    return CustomConnector(connector_class=connector_class, module_path=module, extra_config=extra)


def _allows(field: str) -> str:
    return KVTransferSettings.model_fields[field].description or "a valid value"


def from_env(env: Mapping[str, str]) -> KVTransferSettings:
    """Parse the contract from an environment; raises EnvContractError naming the variable.

    What the seed's compose file leaves out has a default (api.md): the KV port, the buffer, and for
    prefill the decode port; a compose env written for Mooncake's own service (MOONCAKE_BUFFER_SIZE,
    MOONCAKE_RDMA_DEVICE without MOONCAKE_PROTOCOL, which then means RDMA) is understood too.
    """
    for name in _REQUIRED_ENV:
        if not env.get(name, "").strip():
            raise EnvContractError(name, f"required but not set ({_allows(ENV_FIELDS[name])})")
    values: dict[str, Any] = {field: env[name] for name, field in ENV_FIELDS.items() if env.get(name)}
    if "buffer_size_gb" not in values and (size := env.get(ENV_MOONCAKE_BUFFER_SIZE)):
        try:
            values["buffer_size_gb"] = _size_gb(size)
        except ValueError as error:
            raise EnvContractError(ENV_MOONCAKE_BUFFER_SIZE, f"{size!r} {error}") from None
    if "protocol" not in values and env.get(ENV_RDMA_DEVICE, "").strip():
        values["protocol"] = Protocol.RDMA
    values["custom"] = _parse_custom(env)
    _require_peer_for_prefill(env, values)
    side_channel_token(env)  # refused here, at engine start, not at the first transfer
    try:
        return KVTransferSettings.model_validate(values)
    except ValidationError as error:
        raise _naming_the_variable(error, env) from None


def _naming_the_variable(error: ValidationError, env: Mapping[str, str]) -> EnvContractError:
    """The first bad variable, in ENV_FIELDS order, with its value and what it allows."""
    problems = [p for p in error.errors() if p["loc"] and p["loc"][0] in _VARIABLE]
    if not problems:
        return EnvContractError("VLLM_KV_*", "; ".join(p["msg"] for p in error.errors()))
    problem = min(problems, key=lambda p: _ORDER[str(p["loc"][0])])
    field = str(problem["loc"][0])
    own = problem["type"] == "value_error"  # raised by this module, already in the contract's words
    reason = problem["msg"].removeprefix("Value error, ") if own else f"must be {_allows(field)}"
    return EnvContractError(_VARIABLE[field], f"{env[_VARIABLE[field]]!r} {reason}")


def _require_peer_for_prefill(env: Mapping[str, str], values: dict[str, Any]) -> None:
    if env[ENV_ROLE].strip().lower() != Role.PREFILL.value or values["custom"] is not None:
        return
    if "decode_host" not in values:
        raise EnvContractError(ENV_DECODE_IP, "required when VLLM_KV_ROLE=prefill: the decode peer address")
    values.setdefault("decode_port", DEFAULT_KV_PORT)


def side_channel_token(env: Mapping[str, str]) -> str | None:
    """DLLM_KV_AUTH_TOKEN, checked; None when unset. An error never quotes the value."""
    raw = env.get(ENV_KV_AUTH_TOKEN)
    if raw is None or raw == "":
        return None
    token = raw.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise EnvContractError(
            ENV_KV_AUTH_TOKEN,
            f"must be at least {MIN_TOKEN_CHARS} characters (it has {len(token)}); "
            "use 32 random bytes, e.g. `openssl rand -hex 32`",
        )
    if not token.isprintable() or not token.isascii():
        raise EnvContractError(ENV_KV_AUTH_TOKEN, "must be printable ASCII")
    return token
