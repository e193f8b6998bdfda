"""The side channel's hello: one protocol version on every connection; with a key, both ends authenticated."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field

from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_connector.transport.sidechannel.framing import (
    AuthenticationFailed,
    KeyRequired,
    ServerFull,
    VersionMismatch,
    read_exactly,
)
from dllm_contract.kvconfig import MIN_TOKEN_CHARS

MAGIC = b"DLKV"
# The side channel's protocol version: the hello's framing and the messages of
# dllm_connector.pipe.messages together. Bump it with any change a peer of the previous version would
# misread, and say here what changed:
#   1: length-prefixed JSON messages (offer, accept, slot, piece, chunk, done, ack, nack, abort,
#      end); the hello only where a key is configured.
#   2: the hello on every connection, with a flags byte (bit 0: the client has a key); status 3
#      (the server requires a key); the messages a tagged union on `type`.
#      Later: status 4 (the server is full, NEW-7). No bump: a build of version 2 without it reads
#      status 4 as a refusal, and says so; it misreads nothing.
#   3: a zero-copy accept names decode's block addresses as arithmetic (`dst`: per-layer bases and
#      strides, runs, block ids) instead of a list of spans (gpu-review item 5), and says whether
#      decode takes the offered block-to-block write at all (`zero_copy`, item 8).
PROTOCOL_VERSION = 3
NONCE_BYTES = MAC_BYTES = 32
HELLO = struct.Struct(">4sBB2x32s")
CHALLENGE = struct.Struct(">4sBB2x32s32s")
FLAG_KEY = 1
STATUS_OK, STATUS_NO_AUTH, STATUS_BAD_VERSION, STATUS_KEY_REQUIRED, STATUS_FULL = 0, 1, 2, 3, 4
ZERO_NONCE = bytes(32)
AUTH_REQUIRED = "this KV side channel requires authentication: both engines need the same DLLM_KV_AUTH_TOKEN"
SERVER_LABEL = b"dllm-kv-side-channel/1 server"
CLIENT_LABEL = b"dllm-kv-side-channel/1 client"


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
        client_hello(sock, auth, deadline, f"{host}:{port}")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(timeout)  # not what was left of the handshake's deadline
    return sock


def client_hello(sock: socket.socket, auth: PeerAuth | None, deadline: float, peer: str) -> None:
    """The client's half of the handshake: hello, challenge, and with a key the answer."""
    client_nonce = ZERO_NONCE if auth is None else secrets.token_bytes(NONCE_BYTES)
    flags = 0 if auth is None else FLAG_KEY
    try:
        sock.sendall(HELLO.pack(MAGIC, PROTOCOL_VERSION, flags, client_nonce))
        raw = read_exactly(sock, CHALLENGE.size, deadline)
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
    if status == STATUS_FULL:
        raise ServerFull(
            f"the KV side channel at {peer} is full: every connection it serves is busy (offers "
            "waiting for decode to claim them)"
        )
    if status != STATUS_OK:
        raise AuthenticationFailed(f"the KV side channel at {peer} refused the handshake (status {status})")
    if auth is None:
        return
    if not hmac.compare_digest(server_mac, auth.mac(SERVER_LABEL, client_nonce, server_nonce)):
        raise AuthenticationFailed(
            f"the KV side channel at {peer} failed authentication: its DLLM_KV_AUTH_TOKEN differs"
        )
    try:
        sock.sendall(auth.mac(CLIENT_LABEL, client_nonce, server_nonce))
    except OSError as error:
        raise TransportError(f"KV side-channel handshake with {peer} failed: {error}") from None
