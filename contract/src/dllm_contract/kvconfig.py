"""The KV-transfer settings and their environment contract (shared/docs/api.md).

One model, written as env by the operator and read back by `dllm-serve` in the engine pod, so the two
sides cannot drift. Pure: pydantic only, no vLLM, torch or Kubernetes imports (the operator imports it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    model_serializer,
    model_validator,
)


class Connector(StrEnum):
    MOONCAKE = "mooncake"
    PYNCCL = "pynccl"
    CUSTOM = "custom"


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class Compression(StrEnum):
    NONE = "none"
    FP8 = "fp8"
    INT8 = "int8"


class Protocol(StrEnum):
    RDMA = "rdma"
    TCP = "tcp"


class LoadFailurePolicy(StrEnum):
    FAIL = "fail"
    RECOMPUTE = "recompute"


# vLLM's kv_role for each of our roles.
VLLM_KV_ROLE: Mapping[Role, str] = {
    Role.PREFILL: "kv_producer",
    Role.DECODE: "kv_consumer",
    Role.BOTH: "kv_both",
}

# This project's vLLM connector classes (dllm_connector.vllm), one per transport.
CONNECTOR_MODULE = "dllm_connector.vllm"
CONNECTOR_CLASS: Mapping[Connector, str] = {
    Connector.MOONCAKE: "DllmMooncakeConnector",
    Connector.PYNCCL: "DllmNcclConnector",
}

Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonEmpty = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


def _normalized(value: Any) -> Any:
    """Enum values as a person types them in an env file: any case, stray blanks."""
    return value.strip().lower() if isinstance(value, str) else value


def _comma_list(value: Any) -> Any:
    """MOONCAKE_RDMA_DEVICE's form, "mlx5_0,mlx5_1", as a tuple."""
    if not isinstance(value, str):
        return value
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _port_range(value: Any) -> Any:
    """DLLM_KV_TRANSFER_PORTS's form, "LOW-HIGH", as a pair."""
    if not isinstance(value, str):
        return value
    low, dash, high = value.strip().partition("-")
    if not dash or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError("must be LOW-HIGH, two port numbers (e.g. 20000-20015)")
    if problem := transfer_ports_problem(int(low), int(high)):
        raise ValueError(problem)
    return int(low), int(high)


DeviceList = Annotated[tuple[str, ...], BeforeValidator(_comma_list)]
PortRange = Annotated[tuple[Port, Port], BeforeValidator(_port_range)]

# Linux's default ephemeral ports: Mooncake ignores a port range with an end in here (or below 1024)
# and silently draws from 15000-17000 instead; outgoing connections take ports from here too. A
# range touching them is refused up front (as operator/render/ports.py never renders one).
EPHEMERAL_PORTS = (32768, 60999)
# Each engine process (one per TP rank) listens on two ports of the range: the RPC (handshake) port
# and the TCP transport's data port.
PORTS_PER_ENGINE = 2


def transfer_ports_problem(low: int, high: int) -> str | None:
    """Why LOW-HIGH cannot be the KV transfer port range, or None when it can."""
    ephemeral_low, ephemeral_high = EPHEMERAL_PORTS
    if not 1024 <= low <= high <= 65535:
        return "must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535"
    if low <= ephemeral_high and high >= ephemeral_low:
        return (
            f"must lie wholly outside Linux's ephemeral ports {ephemeral_low}-{ephemeral_high} "
            "(Mooncake ignores a range that ends in them and listens on 15000-17000 instead)"
        )
    if high - low + 1 < PORTS_PER_ENGINE:
        return f"must hold at least {PORTS_PER_ENGINE} ports (RPC and data) per TP rank"
    return None


def _check_transfer_ports(ports: tuple[int, int] | None) -> None:
    if ports is not None and (problem := transfer_ports_problem(*ports)):
        raise ValueError(f"transfer_ports {ports[0]}-{ports[1]} {problem}")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CustomConnector(_Frozen):
    """A user's connector class: vLLM built-ins need no module path."""

    connector_class: str = Field(min_length=1)
    module_path: str | None = None
    extra_config: dict[str, Any] = Field(default_factory=dict)


# Each default once; the CRD, the typed API and the pipe take these.
DEFAULT_KV_PORT = 50051
DEFAULT_BUFFER_SIZE_GB = 4.0
DEFAULT_TRANSFER_THRESHOLD_TOKENS = 1024
DEFAULT_TRANSFER_TIMEOUT_MS = 5000
DEFAULT_PREFILL_WAIT_MS = 60000
DEFAULT_HOLD_SECONDS = 480

# What each kind of value allows, in the words an EnvContractError uses.
_PORT = "a port number in 1..65535"
_POSITIVE_WHOLE = "a whole number greater than 0"


def _one_of(enum: type[StrEnum]) -> str:
    return "one of " + ", ".join(member.value for member in enum)


class KVTransferSettings(_Frozen):
    """Everything one engine needs to know about KV transfer.

    The operator builds it from the CR; `from_env` builds it from an engine's environment (strings,
    in pydantic's lax mode). Each field's description says what it allows, for the error that names
    its variable.
    """

    connector: Annotated[Connector, BeforeValidator(_normalized)] = Field(description=_one_of(Connector))
    role: Annotated[Role, BeforeValidator(_normalized)] = Field(description=_one_of(Role))
    listen_port: Port = Field(DEFAULT_KV_PORT, description=_PORT)
    buffer_size_gb: PositiveFloat = Field(DEFAULT_BUFFER_SIZE_GB, description="a number of GB greater than 0")
    compression: Annotated[Compression, BeforeValidator(_normalized)] = Field(
        Compression.NONE, description=_one_of(Compression)
    )
    transfer_threshold_tokens: PositiveInt = Field(
        DEFAULT_TRANSFER_THRESHOLD_TOKENS, description=_POSITIVE_WHOLE
    )
    transfer_timeout_ms: PositiveInt = Field(DEFAULT_TRANSFER_TIMEOUT_MS, description=_POSITIVE_WHOLE)
    # Only the role that uses them carries them (decode waits, prefill holds); unset means the default.
    prefill_wait_ms: PositiveInt | None = Field(None, description=_POSITIVE_WHOLE)
    hold_seconds: PositiveInt | None = Field(None, description=_POSITIVE_WHOLE)
    async_transfer: bool = Field(True, description="true or false")
    load_failure_policy: Annotated[LoadFailurePolicy, BeforeValidator(_normalized)] = Field(
        LoadFailurePolicy.FAIL, description=_one_of(LoadFailurePolicy)
    )
    protocol: Annotated[Protocol, BeforeValidator(_normalized)] = Field(
        Protocol.TCP, description=_one_of(Protocol)
    )
    decode_host: NonEmpty | None = Field(None, description="a host name or address")
    decode_port: Port | None = Field(None, description=_PORT)
    rdma_devices: DeviceList = Field((), description="device names, comma-separated")
    gid_index: Annotated[int, Field(ge=0)] | None = Field(None, description="a whole number, 0 or more")
    custom: CustomConnector | None = None
    transfer_ports: PortRange | None = Field(None, description="LOW-HIGH, two port numbers")
    # Known only inside the pod (downward API); the operator renders them as fieldRefs.
    host_ip: NonEmpty | None = Field(None, description="an address")
    engine_id: NonEmpty | None = Field(None, description="a name")

    @model_validator(mode="after")
    def _check_combinations(self) -> Self:
        if (self.connector is Connector.CUSTOM) != (self.custom is not None):
            raise ValueError("a custom connector class is required iff connector is custom")
        needs_peer = self.role is Role.PREFILL and self.connector is not Connector.CUSTOM
        if needs_peer and (not self.decode_host or self.decode_port is None):
            raise ValueError("prefill needs the decode peer (decode_host and decode_port)")
        _check_transfer_ports(self.transfer_ports)
        return self

    @property
    def sends(self) -> bool:
        return self.role in (Role.PREFILL, Role.BOTH)

    @property
    def receives(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)


class ConnectorExtraConfig(_Frozen):
    """kv_connector_extra_config of this project's connectors: the settings vLLM has no field for.

    Strict (unknown keys and bad values are refused at engine start), because vLLM itself accepts any
    extra config.
    """

    compression: Compression
    buffer_size_gb: PositiveFloat
    transfer_threshold_tokens: PositiveInt
    transfer_timeout_ms: PositiveInt
    prefill_wait_ms: PositiveInt
    hold_seconds: PositiveInt
    async_transfer: bool
    protocol: Protocol
    decode_host: Annotated[str, Field(min_length=1)] | None = None
    decode_port: Port | None = None
    rdma_devices: tuple[str, ...] = ()
    gid_index: Annotated[int, Field(ge=0)] | None = None
    host_ip: str | None = None
    # Mooncake's RPC and data ports (DLLM_KV_TRANSFER_PORTS); left out of the JSON when unset.
    transfer_ports: tuple[Port, Port] | None = None

    @model_validator(mode="after")
    def _check_ports(self) -> Self:
        _check_transfer_ports(self.transfer_ports)
        return self

    @model_serializer(mode="wrap")
    def _omit_unset_ports(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        if dumped.get("transfer_ports", ()) is None:  # engines rendered before the range existed
            del dumped["transfer_ports"]
        return dumped


# The shortest DLLM_KV_AUTH_TOKEN (transport.sidechannel.PeerAuth checks the same).
MIN_TOKEN_CHARS = 32


# ---- the environment contract -------------------------------------------------------------------


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
# vLLM's command line) or any log: the worker reads it from its own environment (kv_worker).
ENV_KV_AUTH_TOKEN = "DLLM_KV_AUTH_TOKEN"  # noqa: S105 - an env name
# "LOW-HIGH": the ports Mooncake listens on, for NetworkPolicies and hostNetwork users.
ENV_TRANSFER_PORTS = "DLLM_KV_TRANSFER_PORTS"
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


# ---- vLLM's --kv-transfer-config ---------------------------------------------------------------


def extra_config(settings: KVTransferSettings) -> ConnectorExtraConfig:
    """The kv_connector_extra_config of this project's connectors for these settings."""
    return ConnectorExtraConfig(
        compression=settings.compression,
        buffer_size_gb=settings.buffer_size_gb,
        transfer_threshold_tokens=settings.transfer_threshold_tokens,
        transfer_timeout_ms=settings.transfer_timeout_ms,
        prefill_wait_ms=settings.prefill_wait_ms or DEFAULT_PREFILL_WAIT_MS,
        hold_seconds=settings.hold_seconds or DEFAULT_HOLD_SECONDS,
        async_transfer=settings.async_transfer,
        protocol=settings.protocol,
        decode_host=settings.decode_host,
        decode_port=settings.decode_port,
        rdma_devices=settings.rdma_devices,
        gid_index=settings.gid_index,
        host_ip=settings.host_ip,
        transfer_ports=settings.transfer_ports,
    )


def kv_transfer_config(settings: KVTransferSettings, engine_id: str) -> dict[str, Any]:
    """vLLM's KVTransferConfig as a dict, with only the fields vLLM really has."""
    config: dict[str, Any] = {
        "kv_role": VLLM_KV_ROLE[settings.role],
        "kv_port": settings.listen_port,
        "engine_id": engine_id,
        "kv_load_failure_policy": settings.load_failure_policy.value,
    }
    if settings.custom is not None:
        config["kv_connector"] = settings.custom.connector_class
        if settings.custom.module_path:
            config["kv_connector_module_path"] = settings.custom.module_path
        config["kv_connector_extra_config"] = dict(settings.custom.extra_config)
    else:
        config["kv_connector"] = CONNECTOR_CLASS[settings.connector]
        config["kv_connector_module_path"] = CONNECTOR_MODULE
        config["kv_connector_extra_config"] = extra_config(settings).model_dump(mode="json")
    return config
