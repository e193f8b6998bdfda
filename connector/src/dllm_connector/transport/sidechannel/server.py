"""The side channel's server: bounded connections, the server's half of the hello, a thread per exchange.

Two bounds (NEW-7): a few connections in their handshake at once (preauth.PreAuthPool, the oldest
evicted for a new one), and the connections past it (capacity.Slots, sized by the receiver from what
decode serves at once). A hello is answered "full" (status 4) when no slot is free, before any key
is checked, so a sender can tell a busy decode from a refusal; the slot itself is taken only once the
peer authenticated, so no unauthenticated peer holds one.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dllm_connector.thread_device import on_callers_device
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.sidechannel.capacity import MIN_CONNECTIONS, PRE_AUTH_CONNECTIONS, Slots
from dllm_connector.transport.sidechannel.framing import (
    PRE_AUTH_LIMIT,
    Accepted,
    read_exactly,
    send_message,
)
from dllm_connector.transport.sidechannel.handshake import (
    AUTH_REQUIRED,
    CHALLENGE,
    CLIENT_LABEL,
    FLAG_KEY,
    HELLO,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    SERVER_LABEL,
    STATUS_BAD_VERSION,
    STATUS_FULL,
    STATUS_KEY_REQUIRED,
    STATUS_NO_AUTH,
    STATUS_OK,
    ZERO_NONCE,
    PeerAuth,
)
from dllm_connector.transport.sidechannel.preauth import PreAuthEntry, PreAuthPool

_log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0


@dataclass
class ServerStats:
    accepted: int = 0  # connections handed a thread
    over_capacity: int = 0  # closed at once: no place in the handshake pool came free in time
    evicted: int = 0  # closed in their handshake to make room for a newer connection
    full: int = 0  # answered "full": every slot past the handshake was busy
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

    At most `pre_auth_connections` are in their handshake at once (a new one evicts the oldest) and
    at most `max_connections` past it (a hello beyond them is answered "full"). `handle` only ever
    sees connections whose hello (of this protocol version) arrived within `handshake_timeout`; with
    `auth`, only authenticated ones.
    """

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket], None],
        *,
        auth: PeerAuth | None = None,
        max_connections: int = MIN_CONNECTIONS,
        pre_auth_connections: int = PRE_AUTH_CONNECTIONS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._handle = handle
        self._auth = auth
        self._handshake_timeout = handshake_timeout
        self._slots = Slots(max_connections)
        self._pre_auth = PreAuthPool(pre_auth_connections)
        self.max_connections = max_connections
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
        # Made on the engine's thread, whose CUDA device (its TP rank's) each connection's thread takes.
        self._serve_on_device = on_callers_device(self._serve)
        self._thread = threading.Thread(target=self._accept_loop, name="kv-side-channel", daemon=True)
        self._thread.start()

    @property
    def handshake_timeout(self) -> float:
        """Seconds a connection has to complete its hello (and, without a key, be admitted)."""
        return self._handshake_timeout

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
            sock = Accepted(conn.family, conn.type, conn.proto, fileno=conn.detach())
            sock.first_message_limit = None
            entry = self._pre_auth.enter(sock)
            if entry is None:
                self._count("over_capacity")
                self._warn.warning(f"closed a connection from {_address(address)}: too many handshakes")
                sock.close()
                continue
            self._count("accepted")
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(
                    target=self._serve_on_device,
                    args=(sock, entry, _address(address)),
                    name="kv-side-conn",
                    daemon=True,
                ).start()
            except (OSError, RuntimeError) as error:  # no thread to be had: drop this connection
                self._pre_auth.leave(entry)
                sock.close()
                self._warn.warning(f"could not serve a connection: {error}")

    def _serve(self, sock: Accepted, entry: PreAuthEntry, peer: str) -> None:
        with sock:
            try:
                admitted = self._admit(sock, entry, peer)
            finally:
                self._pre_auth.leave(entry)
            # Authenticated now. A slot was free at its hello; should a peer of the same moment have
            # taken it since, the next one released within the handshake's time serves.
            if not admitted or not self._slots.take(self._handshake_timeout):
                if admitted:
                    self._count("full")
                    self._warn.warning(f"closed a connection from {peer}: no slot came free after its hello")
                return
            try:
                sock.settimeout(None)  # as accepted: the handle sets its own deadlines
                self._handle(sock)
            finally:
                self._slots.release()

    # the handshake ----------------------------------------------------------------------------------

    def _admit(self, sock: Accepted, entry: PreAuthEntry, peer: str) -> bool:
        """Whether `handle` may have this connection; refusals are counted and logged here."""
        deadline = time.monotonic() + self._handshake_timeout
        read = 0
        answered = False  # whether the peer was sent a status (a later refusal cannot be "full")
        try:
            first = read_exactly(sock, len(MAGIC), deadline)
            read += len(first)
            if first != MAGIC:  # an engine of version 1 without a key: its first message's length
                told = self._no_hello()
                self._refuse(
                    sock, peer, "sent no versioned hello (protocol version 1?)", deadline, read, told
                )
                return False
            hello = first + read_exactly(sock, HELLO.size - len(MAGIC), deadline)
            read = len(hello)
            _, version, flags, client_nonce = HELLO.unpack(hello)
            if version != PROTOCOL_VERSION:
                self._refused(peer, f"it speaks protocol version {version}, this engine {PROTOCOL_VERSION}")
                self._answer(sock, STATUS_BAD_VERSION)
                return False
            if self._slots.free == 0:  # told before any key is checked: says nothing about the key
                self._count("full")
                self._warn.warning(f"answered a connection from {peer} full: every slot is busy")
                self._answer(sock, STATUS_FULL)
                return False
            answered = True
            if self._auth is None:
                return self._admit_without_key(sock, peer, flags) and self._pre_auth.leave(entry)
            if not flags & FLAG_KEY:
                self._refused(peer, "the peer has no DLLM_KV_AUTH_TOKEN, this engine requires one")
                self._answer(sock, STATUS_KEY_REQUIRED)
                return False
            server_nonce = secrets.token_bytes(NONCE_BYTES)
            server_mac = self._auth.mac(SERVER_LABEL, client_nonce, server_nonce)
            sock.sendall(CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, STATUS_OK, server_nonce, server_mac))
            answer = read_exactly(sock, MAC_BYTES, deadline)
            read += len(answer)
            if not hmac.compare_digest(answer, self._auth.mac(CLIENT_LABEL, client_nonce, server_nonce)):
                reason = "wrong MAC (a different DLLM_KV_AUTH_TOKEN?)"
                self._refuse(sock, peer, reason, deadline, read, AUTH_REQUIRED)
                return False
        except TimeoutError:
            self._count("timed_out")
            self._warn.warning(f"closed a connection from {peer}: no handshake within the timeout")
            return False
        except (TransportError, OSError):  # closed or reset mid-handshake: by a client that refused us
            if entry.evicted:  # or shut by the pool, for a newer connection
                self._evicted(sock, peer, answered)
            elif read or self._auth is not None:  # without a key, a bare connect-and-close is no refusal
                self._refused(peer, "closed during the handshake")
            return False
        finally:
            self._note_preauth(read)
        if not self._pre_auth.leave(entry):  # evicted between its answer and here: it may not go on
            self._evicted(sock, peer, answered=True)
            return False
        self._count("authenticated")
        return True

    def _evicted(self, sock: Accepted, peer: str, answered: bool) -> None:
        """Made room for a newer connection: told "full" (the sender retries) unless already answered."""
        self._count("evicted")
        self._warn.warning(f"closed a connection from {peer} in its handshake to make room for a newer one")
        if not answered:
            with contextlib.suppress(OSError):
                self._answer(sock, STATUS_FULL)

    def _admit_without_key(self, sock: Accepted, peer: str, flags: int) -> bool:
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
        sock.sendall(CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, status, ZERO_NONCE, ZERO_NONCE))

    def _no_hello(self) -> str:
        needs = " and requires authentication" if self._auth is not None else ""
        return (
            f"this KV side channel speaks protocol version {PROTOCOL_VERSION}{needs}; the peer sent no "
            "versioned hello (protocol version 1 without a key): run the same dllm version on both "
            "engines, with the same DLLM_KV_AUTH_TOKEN"
        )

    def _refuse(self, sock: Accepted, peer: str, reason: str, deadline: float, read: int, told: str) -> None:
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
