"""Ports for processes that bind them later than the test picks them."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

# A port handed to a process that binds it later (an engine binds its own after loading the model, a
# router after both engines are up) is drawn below the kernel's ephemeral range: other processes'
# sockets (connections, bind-to-0 ports) are numbered from that range, and one took a port drawn
# there before its owner bound it (seen in CI: the dataplane router's, "address already in use").
# Mooncake draws its RPC ports from 15000-17000 unless told otherwise: the band starts above.
_BAND_START = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, from [20000, start of the ephemeral range)."""
    return free_consecutive_ports(1)


def free_consecutive_ports(count: int) -> int:
    """A base port with `count` ports free from it on (a TP group listens on base + rank), all of them in
    [20000, start of the ephemeral range)."""
    band = range(_BAND_START, max(_BAND_START + 1000, _ephemeral_start()) - count + 1)
    for base in random.sample(band, 200):
        with contextlib.ExitStack() as stack:
            try:
                for offset in range(count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + offset))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free port(s) on 127.0.0.1 in {band.start}-{band.stop - 1}")
