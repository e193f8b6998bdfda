"""The side channel: length-prefixed JSON messages over TCP between a prefill and a decode worker.

A one-sided write tells the receiver nothing, so every transfer is framed here: offer, accept (or
reject), done (with the payload's checksum), and the receiver's ack or nack.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from dllm_connector.transport.base import TransferTimeout, TransportError

_LENGTH = struct.Struct(">I")
MAX_MESSAGE_BYTES = 16 << 20

Message = dict[str, Any]


class PeerRefused(TransportError):
    """The peer ended the exchange itself (abort or nack) and sends nothing more."""


def send_message(sock: socket.socket, message: Message) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise TransportError(f"side-channel message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        sock.sendall(_LENGTH.pack(len(body)) + body)
    except OSError as error:
        raise TransportError(f"side channel send failed: {error}") from None


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    chunks: list[bytes] = []
    while count:
        chunk = sock.recv(min(count, 1 << 20))
        if not chunk:
            raise TransportError("side channel closed by the peer")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket, timeout: float) -> Message:
    """The next message, or TransferTimeout after `timeout` seconds, or TransportError."""
    sock.settimeout(max(timeout, 0.001))
    try:
        (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise TransportError(f"side-channel message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
        message = json.loads(_read_exactly(sock, length))
    except TimeoutError:
        raise TransferTimeout(f"no side-channel message within {timeout:.1f}s") from None
    except OSError as error:
        raise TransportError(f"side channel receive failed: {error}") from None
    except json.JSONDecodeError:
        raise TransportError("side-channel message is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise TransportError(f"side-channel message without a type: {message!r}")
    return message


def expect(sock: socket.socket, kind: str, timeout: float) -> Message:
    """The next message, which must be `kind`; an error message from the peer raises with its reason."""
    message = recv_message(sock, timeout)
    if message["type"] == kind:
        return message
    raise unexpected(message, kind)


def unexpected(message: Message, kind: str) -> TransportError:
    """The error for `message` where `kind` was due: PeerRefused if the peer refused or aborted."""
    reason = message.get("reason", message["type"])
    error = PeerRefused if message["type"] in ("abort", "nack") else TransportError
    return error(f"peer answered {message['type']} instead of {kind}: {reason}")


def connect(host: str, port: int, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        raise TransportError(f"cannot reach the KV side channel at {host}:{port}: {error}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Server:
    """Accepts side-channel connections and hands each to `handle` on its own thread."""

    def __init__(self, host: str, port: int, handle: Callable[[socket.socket], None]) -> None:
        self._handle = handle
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as error:
            self._listener.close()
            raise TransportError(f"cannot listen for KV on {host}:{port}: {error}") from None
        self._listener.listen(64)
        self.host, self.port = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), name="kv-side-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            self._handle(sock)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
