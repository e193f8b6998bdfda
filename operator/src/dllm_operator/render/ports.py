"""The engines' KV ports, a pure function of kvTransfer.port (C2: pinned, so they can be declared and
policed). TP rank r's side channel listens on port + r. Mooncake's RPC and data ports (two per TP rank)
come from a range of 128 ports that the connector reads from DLLM_KV_TRANSFER_PORTS ("LOW-HIGH").

Mooncake ignores a range that reaches below 1024 or into Linux's ephemeral ports (32768-60999) and
silently listens on 15000-17000 instead, so the range avoids both: the 128 ports just above the side
channel's 64 (port+64 .. port+191), else the 128 just below the port, else (e.g. the default port 50051,
in the ephemeral range) slot `port mod 35` of the 35 ranges in 61000-65479.
"""

from __future__ import annotations

# The connector's name for it (kvconfig.ENV_TRANSFER_PORTS); the engines get it through to_env.
TRANSFER_PORTS_ENV = "DLLM_KV_TRANSFER_PORTS"
RANGE_SIZE = 128  # two ports per TP rank, up to tensorParallelSize 64
SIDE_CHANNEL_SPAN = 64  # port .. port + 63
MIN_PORT, MAX_PORT = 1024, 65535
EPHEMERAL = (32768, 60999)
SPARE_LOW = EPHEMERAL[1] + 1
SPARE_SLOTS = (MAX_PORT - SPARE_LOW + 1) // RANGE_SIZE  # 35


def side_channel_ports(port: int, tensor_parallel_size: int) -> list[int]:
    return [port + rank for rank in range(tensor_parallel_size)]


def usable(low: int, high: int) -> bool:
    """Above 1023, at most 65535, and wholly outside the ephemeral range."""
    return low >= MIN_PORT and high <= MAX_PORT and (high < EPHEMERAL[0] or low > EPHEMERAL[1])


def transfer_port_range(port: int) -> tuple[int, int]:
    above = (port + SIDE_CHANNEL_SPAN, port + SIDE_CHANNEL_SPAN + RANGE_SIZE - 1)
    below = (port - RANGE_SIZE, port - 1)
    for low, high in (above, below):
        if usable(low, high):
            return low, high
    low = SPARE_LOW + (port % SPARE_SLOTS) * RANGE_SIZE
    return low, low + RANGE_SIZE - 1
