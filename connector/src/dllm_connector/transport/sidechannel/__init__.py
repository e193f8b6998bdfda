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
the version byte); 3 says the server requires a key the client does not have; 4 says the server is
full (every slot busy: ServerFull, which the sender retries). An engine of version 1 without a key
sends no hello: its first four bytes are a message length below 16 MiB, never "DLKV", so the
server tells it apart, answers one `nack` naming both versions and closes. A wrong MAC on
either side closes the connection; the server counts and logs it. The handshake authenticates the
two ends, not each later message: an attacker on the network path could still take over an
established connection, and nothing is encrypted (use the CNI's encryption for that).

The server keeps two pools (NEW-7): connections still in their handshake, a few, where a new one
evicts the oldest; and connections past it, sized from what decode serves at once, where a hello that
finds none free is answered status 4. It puts one deadline on the whole handshake, bounds the first
message of a connection without a key to PRE_AUTH_LIMIT bytes, and keeps accepting after transient
errors (EMFILE etc.).

The messages themselves are typed models (dllm_connector.pipe.messages); this module frames them.
"""

from dllm_connector.transport.sidechannel.capacity import (
    MIN_CONNECTIONS,
    PRE_AUTH_CONNECTIONS,
    connections_for,
)
from dllm_connector.transport.sidechannel.framing import (
    ECHO_CHARS,
    MAX_MESSAGE_BYTES,
    PRE_AUTH_LIMIT,
    AuthenticationFailed,
    KeyRequired,
    Message,
    PeerRefused,
    ServerFull,
    VersionMismatch,
    clip,
    expect,
    read_exactly,
    recv_message,
    send_message,
    unexpected,
)
from dllm_connector.transport.sidechannel.handshake import (
    CHALLENGE,
    FLAG_KEY,
    HELLO,
    MAGIC,
    PROTOCOL_VERSION,
    STATUS_BAD_VERSION,
    STATUS_FULL,
    STATUS_KEY_REQUIRED,
    STATUS_NO_AUTH,
    STATUS_OK,
    PeerAuth,
    client_hello,
    connect,
)
from dllm_connector.transport.sidechannel.server import (
    HANDSHAKE_TIMEOUT_S,
    Server,
    ServerStats,
)

__all__ = [
    "CHALLENGE",
    "ECHO_CHARS",
    "FLAG_KEY",
    "HANDSHAKE_TIMEOUT_S",
    "HELLO",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MIN_CONNECTIONS",
    "PRE_AUTH_CONNECTIONS",
    "PRE_AUTH_LIMIT",
    "PROTOCOL_VERSION",
    "STATUS_BAD_VERSION",
    "STATUS_FULL",
    "STATUS_KEY_REQUIRED",
    "STATUS_NO_AUTH",
    "STATUS_OK",
    "AuthenticationFailed",
    "KeyRequired",
    "Message",
    "PeerAuth",
    "PeerRefused",
    "Server",
    "ServerFull",
    "ServerStats",
    "VersionMismatch",
    "client_hello",
    "clip",
    "connect",
    "connections_for",
    "expect",
    "read_exactly",
    "recv_message",
    "send_message",
    "unexpected",
]
