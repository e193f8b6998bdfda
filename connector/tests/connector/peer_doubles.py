"""Test doubles for the hostile-peer and fault tests, each named as one (docstrings say what they fake).

- FakeDecode: a decode side channel on 127.0.0.1 that answers each connection with a script (a
  broken or hostile decode); it records every connection it got.
- fake_prefill: connects to a real KVReceiver and sends what a test scripts (a hostile prefill).
- GatedTransportDouble: a real one-sided transport whose writes wait for the test to let them go
  and are recorded with their times (the fault: a slow or hung write).
Everything else in these tests is real: KVSender, KVReceiver, Mooncake, sockets.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kv_peer import HOST

from dllm_connector.layout import PagedKV
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import Source, Span, Transport, TransportError


def wait_until(predicate: Callable[[], object], timeout: float, step: float = 0.01) -> bool:
    """Whether `predicate` became true within `timeout` seconds (checked every `step`)."""
    deadline = time.monotonic() + timeout
    event = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        event.wait(step)
    return True


class FakeDecode:
    """Test double: a decode side channel that runs `script(sock)` for each connection it accepts.

    It answers each hello first as a side channel without a key of protocol `version` would (by
    default this engine's); a peer of another version is answered as a real one answers it.
    """

    def __init__(
        self,
        script: Callable[[socket.socket], None],
        host: str = HOST,
        *,
        version: int = sidechannel.PROTOCOL_VERSION,
    ) -> None:
        self._script = script
        self._version = version
        self.connections = 0
        self._listener = socket.socket()
        self._listener.bind((host, 0))
        self._listener.listen(8)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, sock: socket.socket) -> None:
        with sock, contextlib.suppress(Exception):
            hello = sidechannel.HELLO.unpack(
                sidechannel.read_exactly(sock, sidechannel.HELLO.size, time.monotonic() + 10)
            )
            status = sidechannel.STATUS_OK if hello[1] == self._version else sidechannel.STATUS_BAD_VERSION
            sock.sendall(
                sidechannel.CHALLENGE.pack(sidechannel.MAGIC, self._version, status, bytes(32), bytes(32))
            )
            if status == sidechannel.STATUS_OK:
                self._script(sock)

    def close(self) -> None:
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=10)


def offer_for(kv: PagedKV, transfer_id: str, prompt_hash: str, blocks: int, **changes: Any) -> dict[str, Any]:
    """An offer as a KVSender on `kv` would send it (codec none, staged), with `changes` applied."""
    offer: dict[str, Any] = {
        "type": "offer",
        "transfer_id": transfer_id,
        "prompt_hash": prompt_hash,
        "engine_id": None,
        "num_blocks": blocks,
        "codec": "none",
        "zero_copy": False,
        "chunk_blocks": blocks,
        "signature": kv.signature(),
        "endpoint": {},
        "hold_s": 10.0,
        "tag": 1,
        "tp": {"rank": 0, "size": 1, "decode_rank": 0, "heads": None},
    }
    return offer | changes


@contextlib.contextmanager
def fake_prefill(port: int) -> Iterator[socket.socket]:
    """Test double: a prefill connection to a real receiver, driven message by message by the test."""
    with sidechannel.connect(HOST, port, 10) as sock:
        yield sock


def read_until_closed(sock: socket.socket, timeout: float) -> list[dict[str, Any]]:
    """Every message the peer sends until it closes or `timeout` passes."""
    messages = []
    with contextlib.suppress(TransportError):
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            messages.append(sidechannel.recv_message(sock, left))
    return messages


@dataclass(frozen=True)
class Write:
    started: float
    ended: float
    dst: tuple[Span, ...]


class GatedTransportDouble(Transport):
    """Test double around a real one-sided transport: each write first waits until the test lets it
    go (`release`), then runs for real; writes and unregistrations are recorded with their times."""

    name = "gated"
    one_sided = True

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.writes: list[Write] = []
        self.waiting = 0  # writes waiting at the gate
        self.unregistered: list[float] = []
        self._gate = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._open = False

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self._gate.release()

    def open(self) -> None:
        """Let every write through from now on."""
        self._open = True
        self._gate.release(1000)

    def register(self, tensor: torch.Tensor) -> None:
        self.inner.register(tensor)

    def unregister(self, tensor: torch.Tensor) -> None:
        self.unregistered.append(time.monotonic())
        self.inner.unregister(tensor)

    def endpoint(self) -> dict[str, Any]:
        return self.inner.endpoint()

    def send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> None:
        started = time.monotonic()
        with self._lock:
            self.waiting += 1
        if not self._open:
            self._gate.acquire()
        with self._lock:
            self.waiting -= 1
        try:
            self.inner.send(peer, src, dst, tag, timeout)
        finally:
            with self._lock:
                self.writes.append(Write(started, time.monotonic(), tuple(dst)))

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        self.inner.recv(peer, dst, tag, timeout)

    def forget_peer(self, peer: Mapping[str, Any]) -> None:
        self.inner.forget_peer(peer)

    def close(self) -> None:
        self.open()


class OneSidedTransportDouble(Transport):
    """Test double base: a one-sided transport that registers nothing and names no endpoint; each
    subclass says what its writes do (no real transport reports when it reads a source or lets a
    test end a write)."""

    name = "one-sided double"
    one_sided = True

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def register(self, tensor: torch.Tensor) -> None:
        return None

    def unregister(self, tensor: torch.Tensor) -> None:
        return None

    def endpoint(self) -> dict[str, Any]:
        return {}

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None
