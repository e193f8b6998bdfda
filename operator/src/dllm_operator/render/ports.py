"""The engines' KV ports, a pure function of kvTransfer.port (C2: pinned, so they can be declared and
policed). TP rank r's side channel listens on port + r; Mooncake's RPC and data ports come from a range
of 64 ports beside them, which the connector reads from DLLM_KV_TRANSFER_PORTS ("LOW-HIGH")."""

from __future__ import annotations

TRANSFER_PORTS_ENV = "DLLM_KV_TRANSFER_PORTS"
MAX_PORT = 65535
# Side-channel ports take port .. port + 63 (the largest tensor-parallel size is 64).
_SIDE_CHANNEL_SPAN = 64
_RANGE_SIZE = 64


def side_channel_ports(port: int, tensor_parallel_size: int) -> list[int]:
    return [port + rank for rank in range(tensor_parallel_size)]


def transfer_port_range(port: int) -> tuple[int, int]:
    """port+64 .. port+127, or port-64 .. port-1 when that would pass 65535."""
    low = port + _SIDE_CHANNEL_SPAN
    if low + _RANGE_SIZE - 1 <= MAX_PORT:
        return low, low + _RANGE_SIZE - 1
    return port - _RANGE_SIZE, port - 1


def transfer_ports_value(port: int) -> str:
    low, high = transfer_port_range(port)
    return f"{low}-{high}"
