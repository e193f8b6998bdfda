"""The side channel's framing: length-prefixed JSON messages with deadlines and limits, and its errors."""

from __future__ import annotations

import json
import logging
import reprlib
import socket
import struct
import time
from typing import Any

from dllm_connector.transport.base import TransferTimeout, TransportError

_log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_MESSAGE_BYTES = 16 << 20
# The first message of a connection whose peer is not authenticated (no key configured) is an offer:
# a few hundred bytes. Anything larger is refused before it is read.
PRE_AUTH_LIMIT = 64 << 10

# How much of the peer's data an error message or log line may quote (finding L2).
ECHO_CHARS = 200

Message = dict[str, Any]

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = ECHO_CHARS
_repr.maxlevel, _repr.maxlist, _repr.maxdict = 2, 6, 6


def clip(value: Any, limit: int = ECHO_CHARS) -> str:
    """A peer-supplied value as text of at most about `limit` characters (never the whole value)."""
    text = value if isinstance(value, str) else _repr.repr(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


class PeerRefused(TransportError):
    """The peer ended the exchange itself (abort or nack) and sends nothing more."""


class AuthenticationFailed(TransportError):
    """The side-channel handshake failed: a different key, no key on one side, or another version.

    Retrying the same peer does not help until its configuration changes.
    """


class VersionMismatch(AuthenticationFailed):
    """The peer speaks another protocol version; the message names both."""


class KeyRequired(AuthenticationFailed, PeerRefused):
    """The server requires a key (DLLM_KV_AUTH_TOKEN) this client does not have; it refused us."""


class ServerFull(TransportError):
    """Every connection slot of the side channel is busy (offers waiting for decode to claim them).

    Unlike an authentication failure this passes: the sender retries it within its transfer timeout.
    """


class Accepted(socket.socket):
    """A connection the Server accepted: the size limit of the first message read from it."""

    __slots__ = ("first_message_limit",)

    first_message_limit: int | None


def send_message(sock: socket.socket, message: Message) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise TransportError(f"side-channel message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        sock.sendall(_LENGTH.pack(len(body)) + body)
    except OSError as error:
        raise TransportError(f"side channel send failed: {error}") from None


def read_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    """`count` bytes by `deadline` (monotonic) for all of them together; TimeoutError after it.

    Past the deadline, bytes already received still count: a process the host did not run for a while
    (a whole-machine stall) reads what its peer sent in time instead of dropping it unread; a peer that
    is really late gains nothing, since nothing more is waited for."""
    data = bytearray()
    while len(data) < count:
        want, left = min(count - len(data), 1 << 20), deadline - time.monotonic()
        if left > 0:
            sock.settimeout(left)
            chunk = sock.recv(want)
        else:
            chunk = _already_received(sock, want)
        if not chunk:
            raise TransportError("side channel closed by the peer")
        data += chunk
    return bytes(data)


def _already_received(sock: socket.socket, count: int) -> bytes:
    """Up to `count` bytes the socket holds now, without waiting (TimeoutError when it holds none); its
    timeout is left as it was, so a send after this one still waits as it would have."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        return sock.recv(count)
    except BlockingIOError:
        raise TimeoutError from None
    finally:
        sock.settimeout(timeout)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def recv_message(sock: socket.socket, timeout: float, *, limit: int = MAX_MESSAGE_BYTES) -> Message:
    """The next message, whole within `timeout` seconds (TransferTimeout), or TransportError."""
    if isinstance(sock, Accepted) and sock.first_message_limit is not None:
        limit, sock.first_message_limit = min(limit, sock.first_message_limit), None
    deadline = time.monotonic() + max(timeout, 0.001)
    try:
        (length,) = _LENGTH.unpack(read_exactly(sock, _LENGTH.size, deadline))
        if length > limit:
            raise TransportError(f"side-channel message of {length} bytes exceeds {limit}")
        body = read_exactly(sock, length, deadline)
    except TimeoutError:
        raise TransferTimeout(f"no side-channel message within {timeout:.1f}s") from None
    except OSError as error:
        raise TransportError(f"side channel receive failed: {error}") from None
    try:
        message = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, NaN/Infinity, huge ints, deep nesting
        raise TransportError("side-channel message is not JSON") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise TransportError(f"side-channel message without a type: {clip(message)}")
    return message


def expect(sock: socket.socket, kind: str, timeout: float) -> Message:
    """The next message, which must be `kind`; an error message from the peer raises with its reason."""
    message = recv_message(sock, timeout)
    if message["type"] == kind:
        return message
    raise unexpected(message, kind)


def unexpected(message: Message, kind: str) -> TransportError:
    """The error for `message` where `kind` was due: PeerRefused if the peer refused or aborted."""
    reason = clip(message.get("reason", message["type"]))
    error = PeerRefused if message["type"] in ("abort", "nack") else TransportError
    return error(f"peer answered {clip(message['type'], 40)} instead of {kind}: {reason}")
