"""The side channel: length-prefixed JSON messages over TCP between a prefill and a decode worker.

A one-sided write tells the receiver nothing, so every transfer is framed here: offer, accept (or
reject), done (with the payload's checksum), and the receiver's ack or nack.

Every connection starts with a fixed-size hello, before any JSON is read and before the server's
handler runs, so two engines that speak different protocol versions always refuse each other with a
message naming both versions. With a `PeerAuth` (the shared DLLM_KV_AUTH_TOKEN, security review H4,
C2) on both ends, the hello also authenticates both ends:

    client -> server  hello      40 bytes  "DLKV" | version u8 | flags u8 | 2 zero bytes | client nonce (32)
    server -> client  challenge  72 bytes  "DLKV" | version u8 | status u8 | 2 zero bytes
                                           | server nonce (32) | server MAC (32)
    client -> server  answer     32 bytes  client MAC (only when both ends have a key)

    flags bit 0: the client has a key (without one its nonce is zero)
    server MAC = HMAC-SHA256(key, "dllm-kv-side-channel/1 server" | client nonce | server nonce)
    client MAC = HMAC-SHA256(key, "dllm-kv-side-channel/1 client" | client nonce | server nonce)

Both nonces are fresh random bytes, so a recorded handshake cannot be replayed, and the role labels
keep one side's MAC from being reflected as the other's. MACs are compared with
`hmac.compare_digest`. Without a key on either end, nonce and MACs are zero. Status 0 is ok; 1 says
the server has no key but the client has; 2 says the server speaks another version (its own is in
the version byte); 3 says the server requires a key the client does not have. An engine of version 1
without a key sends no hello: its first four bytes are a message length below 16 MiB, never "DLKV",
so the server tells it apart, answers one `nack` naming both versions and closes. A wrong MAC on
either side closes the connection; the server counts and logs it. The handshake authenticates the
two ends, not each later message: an attacker on the network path could still take over an
established connection, and nothing is encrypted (use the CNI's encryption for that).

The server also caps concurrent connections (more are closed at once), puts one deadline on the whole
handshake, bounds the first message of a connection without a key to PRE_AUTH_LIMIT bytes, and keeps
accepting after transient errors (EMFILE etc.).

The messages themselves are typed models (dllm_connector.pipe.messages); this module frames them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import reprlib
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_contract.kvconfig import MIN_TOKEN_CHARS

_log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_MESSAGE_BYTES = 16 << 20
# The first message of a connection whose peer is not authenticated (no key configured) is an offer:
# a few hundred bytes. Anything larger is refused before it is read.
PRE_AUTH_LIMIT = 64 << 10
HANDSHAKE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
# How much of the peer's data an error message or log line may quote (finding L2).
ECHO_CHARS = 200

MAGIC = b"DLKV"
# The side channel's protocol version: the hello's framing and the messages of
# dllm_connector.pipe.messages together. Bump it with any change a peer of the previous version would
# misread, and say here what changed:
#   1: length-prefixed JSON messages (offer, accept, slot, piece, chunk, done, ack, nack, abort,
#      end); the hello only where a key is configured.
#   2: the hello on every connection, with a flags byte (bit 0: the client has a key); status 3
#      (the server requires a key); the messages a tagged union on `type`.
PROTOCOL_VERSION = 2
NONCE_BYTES = MAC_BYTES = 32
HELLO = struct.Struct(">4sBB2x32s")
CHALLENGE = struct.Struct(">4sBB2x32s32s")
FLAG_KEY = 1
STATUS_OK, STATUS_NO_AUTH, STATUS_BAD_VERSION, STATUS_KEY_REQUIRED = 0, 1, 2, 3
_ZERO = bytes(32)
_AUTH_REQUIRED = "this KV side channel requires authentication: both engines need the same DLLM_KV_AUTH_TOKEN"
_SERVER_LABEL = b"dllm-kv-side-channel/1 server"
_CLIENT_LABEL = b"dllm-kv-side-channel/1 client"

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


@dataclass(frozen=True)
class PeerAuth:
    """The side channel's shared key (from DLLM_KV_AUTH_TOKEN); never shown in a repr."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < MIN_TOKEN_CHARS:
            raise ValueError(f"a side-channel key needs at least {MIN_TOKEN_CHARS} bytes")

    @classmethod
    def from_token(cls, token: str) -> PeerAuth:
        """The key for a token; surrounding whitespace (a Secret's trailing newline) is ignored."""
        token = token.strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"must be at least {MIN_TOKEN_CHARS} characters (has {len(token)}); "
                "use 32 random bytes, e.g. `openssl rand -hex 32`"
            )
        return cls(token.encode())

    def mac(self, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
        return hmac.new(self.key, label + client_nonce + server_nonce, hashlib.sha256).digest()


# ---- messages -------------------------------------------------------------------------------------


class _Accepted(socket.socket):
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


def _read_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    """`count` bytes by `deadline` (monotonic) for all of them together; TimeoutError after it."""
    data = bytearray()
    while len(data) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(count - len(data), 1 << 20))
        if not chunk:
            raise TransportError("side channel closed by the peer")
        data += chunk
    return bytes(data)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def recv_message(sock: socket.socket, timeout: float, *, limit: int = MAX_MESSAGE_BYTES) -> Message:
    """The next message, whole within `timeout` seconds (TransferTimeout), or TransportError."""
    if isinstance(sock, _Accepted) and sock.first_message_limit is not None:
        limit, sock.first_message_limit = min(limit, sock.first_message_limit), None
    deadline = time.monotonic() + max(timeout, 0.001)
    try:
        (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size, deadline))
        if length > limit:
            raise TransportError(f"side-channel message of {length} bytes exceeds {limit}")
        body = _read_exactly(sock, length, deadline)
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


# ---- client -----------------------------------------------------------------------------------------


def connect(host: str, port: int, timeout: float, *, auth: PeerAuth | None = None) -> socket.socket:
    """A connection to a side channel, its hello answered within `timeout` (the same protocol
    version; with `auth`, authenticated both ways)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as error:
        raise TransportError(f"cannot reach the KV side channel at {host}:{port}: {error}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        _hello(sock, auth, deadline, f"{host}:{port}")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(timeout)  # not what was left of the handshake's deadline
    return sock


def _hello(sock: socket.socket, auth: PeerAuth | None, deadline: float, peer: str) -> None:
    """The client's half of the handshake: hello, challenge, and with a key the answer."""
    client_nonce = _ZERO if auth is None else secrets.token_bytes(NONCE_BYTES)
    flags = 0 if auth is None else FLAG_KEY
    try:
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION, flags, client_nonce))
        raw = _read_exactly(sock, CHALLENGE.size, deadline)
    except TimeoutError:
        raise TransferTimeout(f"the KV side channel at {peer} did not answer the handshake in time") from None
    except (TransportError, ConnectionError):  # closed: a full server, or one that misread the hello
        raise AuthenticationFailed(
            f"the KV side channel at {peer} closed the connection during the handshake: it is full, "
            f"or an engine that does not speak this engine's protocol version {PROTOCOL_VERSION}"
        ) from None
    except OSError as error:
        raise TransportError(f"KV side-channel handshake with {peer} failed: {error}") from None
    magic, version, status, server_nonce, server_mac = CHALLENGE.unpack(raw)
    if magic != MAGIC:
        raise AuthenticationFailed(f"the KV side channel at {peer} does not speak the dllm handshake")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"the KV side channel at {peer} speaks protocol version {version}, this engine {PROTOCOL_VERSION}"
        )
    if status == STATUS_NO_AUTH:
        raise AuthenticationFailed(
            f"the KV side channel at {peer} does not authenticate peers, but this engine has a key: "
            "set the same DLLM_KV_AUTH_TOKEN on both engines"
        )
    if status == STATUS_KEY_REQUIRED:
        raise KeyRequired(
            f"the KV side channel at {peer} requires authentication, but this engine has no key: "
            "set the same DLLM_KV_AUTH_TOKEN on both engines"
        )
    if status != STATUS_OK:
        raise AuthenticationFailed(f"the KV side channel at {peer} refused the handshake (status {status})")
    if auth is None:
        return
    if not hmac.compare_digest(server_mac, auth.mac(_SERVER_LABEL, client_nonce, server_nonce)):
        raise AuthenticationFailed(
            f"the KV side channel at {peer} failed authentication: its DLLM_KV_AUTH_TOKEN differs"
        )
    try:
        sock.sendall(auth.mac(_CLIENT_LABEL, client_nonce, server_nonce))
    except OSError as error:
        raise TransportError(f"KV side-channel handshake with {peer} failed: {error}") from None


# ---- server -----------------------------------------------------------------------------------------


@dataclass
class ServerStats:
    accepted: int = 0  # connections handed a thread
    over_capacity: int = 0  # closed at once: max_connections were busy
    authenticated: int = 0
    refused: int = 0  # failed or mismatched handshakes
    timed_out: int = 0  # no complete hello (or first message) within the handshake timeout
    accept_errors: int = 0  # transient accept() failures survived
    preauth_bytes_max: int = 0  # the most bytes read from one connection before it was authenticated


class _RateLimitedLog:
    """One warning line per `interval` seconds at most; the lines held back are counted in the next."""

    def __init__(self, interval: float = 1.0) -> None:
        self._interval = interval
        self._next = 0.0
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, text: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._held += 1
                return
            held, self._held, self._next = self._held, 0, now + self._interval
        _log.warning("KV side channel: %s%s", text, f" ({held} more not logged)" if held else "")


class Server:
    """Accepts side-channel connections and hands each to `handle` on its own thread.

    At most `max_connections` run at once (more are closed at once). `handle` only ever sees
    connections whose hello (of this protocol version) arrived within `handshake_timeout`; with
    `auth`, only authenticated ones.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket], None],
        *,
        auth: PeerAuth | None = None,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._handle = handle
        self._auth = auth
        self._handshake_timeout = handshake_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stats = ServerStats()
        self._stats_lock = threading.Lock()
        self._warn = _RateLimitedLog()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as error:
            self._listener.close()
            raise TransportError(f"cannot listen for KV on {host}:{port}: {error}") from None
        self._listener.listen(max(128, 2 * max_connections))
        self.host, self.port = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-side-channel", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> ServerStats:
        with self._stats_lock:
            return replace(self._stats)

    def _count(self, name: str, add: int = 1) -> None:
        with self._stats_lock:
            setattr(self._stats, name, getattr(self._stats, name) + add)

    def _accept_one(self) -> tuple[socket.socket, Any]:
        return self._listener.accept()

    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._closed.is_set():
            try:
                conn, address = self._accept_one()
            except OSError as error:
                if self._closed.is_set() or self._listener.fileno() < 0:
                    return  # closed: the only way this loop ends
                # EMFILE/ENFILE/ENOBUFS/ENOMEM pass once connections close; ECONNABORTED and the like
                # concern one connection only. Back off so a persistent error does not spin.
                self._count("accept_errors")
                transient = error.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR)
                backoff = 0.0 if transient else min(1.0, max(0.01, backoff * 2))
                self._warn.warning(f"accept failed ({error.strerror or error}); retrying")
                self._closed.wait(backoff)
                continue
            backoff = 0.0
            sock = _Accepted(conn.family, conn.type, conn.proto, fileno=conn.detach())
            sock.first_message_limit = None
            if not self._slots.acquire(blocking=False):
                self._count("over_capacity")
                self._warn.warning(f"closed a connection from {_address(address)}: too many connections")
                sock.close()
                continue
            self._count("accepted")
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(
                    target=self._serve, args=(sock, _address(address)), name="kv-side-conn", daemon=True
                ).start()
            except (OSError, RuntimeError) as error:  # no thread to be had: drop this connection
                self._slots.release()
                sock.close()
                self._warn.warning(f"could not serve a connection: {error}")

    def _serve(self, sock: _Accepted, peer: str) -> None:
        try:
            with sock:
                if self._admit(sock, peer):
                    sock.settimeout(None)  # as accepted: the handle sets its own deadlines
                    self._handle(sock)
        finally:
            self._slots.release()

    # the handshake ----------------------------------------------------------------------------------

    def _admit(self, sock: _Accepted, peer: str) -> bool:
        """Whether `handle` may have this connection; refusals are counted and logged here."""
        deadline = time.monotonic() + self._handshake_timeout
        read = 0
        try:
            first = _read_exactly(sock, len(MAGIC), deadline)
            read += len(first)
            if first != MAGIC:  # an engine of version 1 without a key: its first message's length
                told = self._no_hello()
                self._refuse(
                    sock, peer, "sent no versioned hello (protocol version 1?)", deadline, read, told
                )
                return False
            hello = first + _read_exactly(sock, HELLO.size - len(MAGIC), deadline)
            read = len(hello)
            _, version, flags, client_nonce = HELLO.unpack(hello)
            if version != PROTOCOL_VERSION:
                self._refused(peer, f"it speaks protocol version {version}, this engine {PROTOCOL_VERSION}")
                self._answer(sock, STATUS_BAD_VERSION)
                return False
            if self._auth is None:
                return self._admit_without_key(sock, peer, flags)
            if not flags & FLAG_KEY:
                self._refused(peer, "the peer has no DLLM_KV_AUTH_TOKEN, this engine requires one")
                self._answer(sock, STATUS_KEY_REQUIRED)
                return False
            server_nonce = secrets.token_bytes(NONCE_BYTES)
            server_mac = self._auth.mac(_SERVER_LABEL, client_nonce, server_nonce)
            sock.sendall(CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, STATUS_OK, server_nonce, server_mac))
            answer = _read_exactly(sock, MAC_BYTES, deadline)
            read += len(answer)
            if not hmac.compare_digest(answer, self._auth.mac(_CLIENT_LABEL, client_nonce, server_nonce)):
                reason = "wrong MAC (a different DLLM_KV_AUTH_TOKEN?)"
                self._refuse(sock, peer, reason, deadline, read, _AUTH_REQUIRED)
                return False
        except TimeoutError:
            self._count("timed_out")
            self._warn.warning(f"closed a connection from {peer}: no handshake within the timeout")
            return False
        except (TransportError, OSError):  # closed or reset mid-handshake: by a client that refused us
            if read or self._auth is not None:  # without a key, a bare connect-and-close is no refusal
                self._refused(peer, "closed during the handshake")
            return False
        finally:
            self._note_preauth(read)
        self._count("authenticated")
        return True

    def _admit_without_key(self, sock: _Accepted, peer: str, flags: int) -> bool:
        """No key here: refuse a client that wants to authenticate; bound the first message."""
        if flags & FLAG_KEY:
            self._refused(peer, "the peer authenticates but this engine has no DLLM_KV_AUTH_TOKEN")
            with contextlib.suppress(OSError):
                self._answer(sock, STATUS_NO_AUTH)
            return False
        self._answer(sock, STATUS_OK)
        sock.first_message_limit = PRE_AUTH_LIMIT
        return True

    def _answer(self, sock: socket.socket, status: int) -> None:
        """A challenge without nonce or MAC: for the statuses that carry none, and for ok without a key."""
        sock.sendall(CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, status, _ZERO, _ZERO))

    def _no_hello(self) -> str:
        needs = " and requires authentication" if self._auth is not None else ""
        return (
            f"this KV side channel speaks protocol version {PROTOCOL_VERSION}{needs}; the peer sent no "
            "versioned hello (protocol version 1 without a key): run the same dllm version on both "
            "engines, with the same DLLM_KV_AUTH_TOKEN"
        )

    def _refuse(self, sock: _Accepted, peer: str, reason: str, deadline: float, read: int, told: str) -> None:
        """Tell a client `told` (in the message framing it reads), then close without a reset."""
        self._refused(peer, reason)
        with contextlib.suppress(TransportError, OSError):
            send_message(sock, {"type": "nack", "reason": told})
            # Closing with unread data would reset the connection before the client reads the nack:
            # read what it already sent, bounded in bytes and time.
            sock.shutdown(socket.SHUT_WR)
            limit = min(deadline, time.monotonic() + 1.0)
            while read < PRE_AUTH_LIMIT:
                left = limit - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                chunk = sock.recv(min(PRE_AUTH_LIMIT - read, 1 << 16))
                if not chunk:
                    break
                read += len(chunk)
        self._note_preauth(read)

    def _refused(self, peer: str, reason: str) -> None:
        self._count("refused")
        self._warn.warning(f"refused a connection from {peer}: {reason}")

    def _note_preauth(self, read: int) -> None:
        with self._stats_lock:
            self._stats.preauth_bytes_max = max(self._stats.preauth_bytes_max, read)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)


def _address(address: Any) -> str:
    try:
        host, port = address[:2]
    except (TypeError, ValueError):
        return "?"
    return f"{host}:{port}"
