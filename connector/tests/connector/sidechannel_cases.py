"""What the KV side channel tests share: a real Server on 127.0.0.1 whose handler echoes an offer, a
client exchange through it, and ways to watch its connection threads and a peer's sockets close.

A test module collects `serve` by binding it to a name of its own: `serve = sidechannel_cases.serve`.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import pytest

from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.sidechannel import PeerAuth, Server

HOST = "127.0.0.1"
KEY = PeerAuth.from_token("a" * 64)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return False
        pause.wait(0.01)
    return True


class Echo:
    """A handle like the receiver's: reads one offer, answers accept with the offer's id."""

    def __init__(self) -> None:
        self.calls = 0
        self.errors: list[str] = []
        self.timeouts: list[float | None] = []

    def __call__(self, sock: socket.socket) -> None:
        self.calls += 1
        self.timeouts.append(sock.gettimeout())
        try:
            offer = sidechannel.expect(sock, "offer", 5)
            sidechannel.send_message(sock, {"type": "accept", "id": offer.get("id")})
        except TransportError as error:
            self.errors.append(str(error))


class Serve(Protocol):
    """What the `serve` fixture yields: starts a Server on HOST that answers with an Echo; the
    keywords are Server's own."""

    def __call__(
        self,
        *,
        auth: PeerAuth | None = ...,
        max_connections: int = ...,
        pre_auth_connections: int = ...,
        handshake_timeout: float = ...,
    ) -> tuple[Server, Echo]: ...


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[Server] = []

    def start(**kwargs: object) -> tuple[Server, Echo]:
        handle = Echo()
        server = Server(HOST, 0, handle, **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server, handle

    yield start
    for server in servers:
        server.close()


def exchange(server: Server, auth: PeerAuth | None) -> str:
    with sidechannel.connect(HOST, server.port, 5, auth=auth) as sock:
        sidechannel.send_message(sock, {"type": "offer", "id": "t1"})
        return str(sidechannel.expect(sock, "accept", 5)["id"])


def connection_threads() -> int:
    return sum(thread.name == "kv-side-conn" for thread in threading.enumerate())


def closed_within(socks: list[socket.socket], timeout: float) -> int:
    """How many of `socks` saw their connection end (EOF or reset) within `timeout` seconds."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + timeout
    while closed < len(socks) and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            ready = key.fileobj
            assert isinstance(ready, socket.socket)
            try:
                data = ready.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                selector.unregister(ready)
                closed += 1
    selector.close()
    return closed
