"""Helper processes for the Mooncake port and timeout tests (real Mooncake engines over TCP on 127.0.0.1).

`python mooncake_peer.py peer`: one engine with a registered 1 MiB buffer and an unregistered one;
prints {"session", "pid", "registered", "unregistered"}, waits for stdin to close, then prints how
many bytes of each buffer hold the value 7.

`python mooncake_peer.py ports LOW HIGH`: two engines on the range LOW-HIGH write to each other; prints
{"sessions", "listening", "equal"}: the TCP ports this process listens on, read from /proc.

`python mooncake_peer.py late-range LOW HIGH`: an engine without a range, then one with LOW-HIGH;
prints the second one's error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from dllm_connector.transport.base import Span, TransportError
from dllm_connector.transport.mooncake import MooncakeTransport

HOST = "127.0.0.1"


def listening_ports() -> list[int]:
    """The TCP ports this process listens on: its socket inodes matched against /proc/net/tcp{,6}."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def peer() -> None:
    engine = MooncakeTransport(HOST)
    registered = torch.zeros(1 << 20, dtype=torch.uint8)
    unregistered = torch.zeros(1 << 20, dtype=torch.uint8)
    engine.register(registered)
    info = {
        "session": engine.session_id,
        "pid": os.getpid(),
        "registered": registered.data_ptr(),
        "unregistered": unregistered.data_ptr(),
    }
    print(json.dumps(info), flush=True)
    sys.stdin.read()
    landed = {"registered": int((registered == 7).sum()), "unregistered": int((unregistered == 7).sum())}
    print(json.dumps(landed), flush=True)


def ports(low: int, high: int) -> None:
    first = MooncakeTransport(HOST, rpc_ports=(low, high))
    second = MooncakeTransport(HOST, rpc_ports=(low, high))
    src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    first.register(src)
    second.register(dst)
    first.send(second.endpoint(), [src], [Span(dst.data_ptr(), 4096)], 0, 10)
    sessions = [first.session_id, second.session_id]
    print(
        json.dumps({"sessions": sessions, "listening": listening_ports(), "equal": bool((src == dst).all())})
    )


def late_range(low: int, high: int) -> None:
    MooncakeTransport(HOST)
    try:
        MooncakeTransport(HOST, rpc_ports=(low, high))
    except TransportError as error:
        print(json.dumps({"error": str(error)}))
        return
    print(json.dumps({"error": None}))


if __name__ == "__main__":
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST
    mode, *args = sys.argv[1:]
    if mode == "peer":
        peer()
    elif mode == "ports":
        ports(int(args[0]), int(args[1]))
    else:
        late_range(int(args[0]), int(args[1]))
