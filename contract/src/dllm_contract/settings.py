"""The KV-transfer settings: one model from the CR to the engine, its enums, types and defaults.

Pure: pydantic only. The operator builds KVTransferSettings from a CR, `env.from_env` builds it from an
engine's environment; each default is written here once.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from dllm_contract.types import NonEmpty, Port, PositiveFloat, PositiveInt


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


class KVTransferShared(_Frozen):
    """The settings both the env contract (KVTransferSettings) and the connector's extra config
    (vllm_config.ConnectorExtraConfig) carry, each declared here once: its type, bounds and default.
    The order is the extra config's JSON order (dllm-serve prints that command exactly)."""

    compression: Annotated[Compression, BeforeValidator(_normalized)] = Field(
        Compression.NONE, description=_one_of(Compression)
    )
    buffer_size_gb: PositiveFloat = Field(DEFAULT_BUFFER_SIZE_GB, description="a number of GB greater than 0")
    transfer_threshold_tokens: PositiveInt = Field(
        DEFAULT_TRANSFER_THRESHOLD_TOKENS, description=_POSITIVE_WHOLE
    )
    transfer_timeout_ms: PositiveInt = Field(DEFAULT_TRANSFER_TIMEOUT_MS, description=_POSITIVE_WHOLE)
    # Only the role that uses them carries them in the settings (decode waits, prefill holds); unset means
    # the default, which the extra config (where the engine reads them) always has.
    prefill_wait_ms: PositiveInt | None = Field(None, description=_POSITIVE_WHOLE)
    hold_seconds: PositiveInt | None = Field(None, description=_POSITIVE_WHOLE)
    async_transfer: bool = Field(True, description="true or false")
    protocol: Annotated[Protocol, BeforeValidator(_normalized)] = Field(
        Protocol.TCP, description=_one_of(Protocol)
    )
    decode_host: NonEmpty | None = Field(None, description="a host name or address")
    decode_port: Port | None = Field(None, description=_PORT)
    rdma_devices: DeviceList = Field((), description="device names, comma-separated")
    gid_index: Annotated[int, Field(ge=0)] | None = Field(None, description="a whole number, 0 or more")
    # Known only inside the pod (downward API); the operator renders it as a fieldRef.
    host_ip: NonEmpty | None = Field(None, description="an address")
    # Mooncake's RPC and data ports (DLLM_KV_TRANSFER_PORTS).
    transfer_ports: PortRange | None = Field(None, description="LOW-HIGH, two port numbers")
    # The other role's tensor-parallel size (DLLM_KV_PEER_TP_SIZE): decode's on prefill, prefill's on
    # decode. A request may name no other (C1), and decode sizes its side channel by it (NEW-7).
    # Unset: the engine's own.
    peer_tp_size: PositiveInt | None = Field(None, description=_POSITIVE_WHOLE)

    @model_validator(mode="after")
    def _check_ports(self) -> Self:
        _check_transfer_ports(self.transfer_ports)
        return self


class KVTransferSettings(KVTransferShared):
    """Everything one engine needs to know about KV transfer.

    The operator builds it from the CR; `from_env` builds it from an engine's environment (strings,
    in pydantic's lax mode). Each field's description says what it allows, for the error that names
    its variable.
    """

    connector: Annotated[Connector, BeforeValidator(_normalized)] = Field(description=_one_of(Connector))
    role: Annotated[Role, BeforeValidator(_normalized)] = Field(description=_one_of(Role))
    listen_port: Port = Field(DEFAULT_KV_PORT, description=_PORT)
    load_failure_policy: Annotated[LoadFailurePolicy, BeforeValidator(_normalized)] = Field(
        LoadFailurePolicy.FAIL, description=_one_of(LoadFailurePolicy)
    )
    custom: CustomConnector | None = None
    engine_id: NonEmpty | None = Field(None, description="a name")

    @model_validator(mode="after")
    def _check_combinations(self) -> Self:
        if (self.connector is Connector.CUSTOM) != (self.custom is not None):
            raise ValueError("a custom connector class is required iff connector is custom")
        needs_peer = self.role is Role.PREFILL and self.connector is not Connector.CUSTOM
        if needs_peer and (not self.decode_host or self.decode_port is None):
            raise ValueError("prefill needs the decode peer (decode_host and decode_port)")
        return self

    @property
    def sends(self) -> bool:
        return self.role in (Role.PREFILL, Role.BOTH)

    @property
    def receives(self) -> bool:
        return self.role in (Role.DECODE, Role.BOTH)
