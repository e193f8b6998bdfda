"""The KV side channel authenticates both ends before any JSON, and survives hostile peers (H4, C2, L2).

Real sockets on 127.0.0.1, a real Server and real clients; the only stand-in is the one accept()
failure of the EMFILE test, injected where the listener's accept is called.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_connector.transport.sidechannel import (
    PRE_AUTH_LIMIT,
    AuthenticationFailed,
    PeerAuth,
    PeerRefused,
    Server,
)

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
KEY = PeerAuth.from_token("a" * 64)
OTHER_KEY = PeerAuth.from_token("b" * 64)


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


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[Server, Echo]]]:
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


def test_the_same_key_on_both_ends_authenticates_and_exchanges(serve) -> None:
    server, handle = serve(auth=KEY)
    assert exchange(server, KEY) == "t1"
    assert handle.calls == 1
    assert server.stats.authenticated == 1
    assert server.stats.refused == 0


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
def test_after_the_handshake_sockets_have_the_usual_timeouts(serve, auth) -> None:
    """Not what was left of the handshake's deadline: the client's connect timeout, none on the server."""
    server, handle = serve(auth=auth)
    with sidechannel.connect(HOST, server.port, 7.5, auth=auth) as sock:
        assert sock.gettimeout() == 7.5
        sidechannel.send_message(sock, {"type": "offer", "id": "t1"})
        sidechannel.expect(sock, "accept", 5)
    assert handle.timeouts == [None]


def test_no_key_on_either_end_keeps_todays_behaviour(serve) -> None:
    server, handle = serve()
    assert exchange(server, None) == "t1"
    assert handle.calls == 1


@pytest.mark.parametrize(("client", "server_key"), [(KEY, OTHER_KEY), (OTHER_KEY, KEY)])
def test_a_different_key_is_refused_and_the_handler_never_runs(serve, client, server_key) -> None:
    server, handle = serve(auth=server_key)
    with pytest.raises(AuthenticationFailed, match="DLLM_KV_AUTH_TOKEN differs"):
        sidechannel.connect(HOST, server.port, 5, auth=client)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0
    assert exchange(server, server_key) == "t1"  # the server is still fine


def test_a_client_that_cannot_answer_the_challenge_is_refused_before_any_json(serve) -> None:
    """A peer without the key: a well-formed hello, then a guessed MAC and an offer."""
    server, handle = serve(auth=KEY)
    with socket.create_connection((HOST, server.port), timeout=5) as sock:
        sock.sendall(
            sidechannel.HELLO.pack(
                sidechannel.MAGIC, sidechannel.PROTOCOL_VERSION, sidechannel.FLAG_KEY, bytes(32)
            )
        )
        challenge = sidechannel.read_exactly(sock, sidechannel.CHALLENGE.size, time.monotonic() + 5)
        assert challenge[:4] == sidechannel.MAGIC
        sock.sendall(bytes(32))
        sidechannel.send_message(sock, {"type": "offer", "id": "forged"})
        with pytest.raises(PeerRefused, match="requires authentication"):
            sidechannel.expect(sock, "accept", 5)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0


def test_a_client_without_a_key_is_told_that_the_server_requires_one(serve) -> None:
    server, handle = serve(auth=KEY)
    with pytest.raises(PeerRefused, match=r"requires authentication.*DLLM_KV_AUTH_TOKEN"):
        exchange(server, None)
    assert handle.calls == 0
    assert server.stats.refused == 1


def test_a_client_with_a_key_is_told_that_the_server_has_none(serve) -> None:
    server, handle = serve()
    with pytest.raises(AuthenticationFailed, match=r"does not authenticate peers.*DLLM_KV_AUTH_TOKEN"):
        sidechannel.connect(HOST, server.port, 5, auth=KEY)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0


def _connection_threads() -> int:
    return sum(thread.name == "kv-side-conn" for thread in threading.enumerate())


def _closed_within(socks: list[socket.socket], timeout: float) -> int:
    """How many of `socks` saw their connection end (EOF or reset) within `timeout` seconds."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + timeout
    while closed < len(socks) and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                selector.unregister(sock)
                closed += 1
    selector.close()
    return closed


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
def test_500_silent_connections_hold_at_most_the_cap_and_all_close_by_the_deadline(serve, auth) -> None:
    cap, deadline_s = 16, 1.0
    server, handle = serve(auth=auth, max_connections=cap, handshake_timeout=deadline_s)
    before = _connection_threads()
    socks: list[socket.socket] = []
    most = 0
    try:
        for _ in range(500):
            socks.append(socket.create_connection((HOST, server.port), timeout=5))
            most = max(most, _connection_threads())
        started = time.monotonic()
        assert _closed_within(socks, deadline_s + 10) == 500
        elapsed = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
    assert most - before <= cap
    assert server.stats.over_capacity > 0  # the cap was reached
    assert elapsed < deadline_s + 10
    stats = server.stats
    assert stats.accepted <= 500
    assert stats.over_capacity + stats.accepted == 500
    assert stats.timed_out == stats.accepted
    assert handle.calls == 0
    assert wait_until(lambda: _connection_threads() == before)
    assert exchange(server, auth) == "t1"  # and it still serves


def test_accept_failing_with_emfile_once_does_not_end_the_listener(serve, monkeypatch) -> None:
    real = Server._accept_one
    failures = [OSError(errno.EMFILE, "Too many open files")]

    def accept_once_failing(self: Server) -> tuple[socket.socket, object]:
        if failures:
            raise failures.pop()
        return real(self)

    monkeypatch.setattr(Server, "_accept_one", accept_once_failing)
    server, handle = serve(auth=KEY)
    assert exchange(server, KEY) == "t1"
    assert server.stats.accept_errors == 1
    assert handle.calls == 1


_REAL_EMFILE = """
import json, os, resource, socket, threading, time
from dllm_connector.transport import sidechannel
from dllm_connector.transport.sidechannel import PeerAuth, Server

key = PeerAuth.from_token("a" * 64)

def handle(sock):
    offer = sidechannel.expect(sock, "offer", 5)
    sidechannel.send_message(sock, {"type": "accept", "id": offer["id"]})

server = Server("127.0.0.1", 0, handle, auth=key)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # the client's, before the table is full
fillers = []
try:
    while True:
        fillers.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
answers = []

def client():
    # What sidechannel.connect does, on the socket made before: it needs no descriptor now.
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    sidechannel.client_hello(sock, key, time.monotonic() + 30, "server")
    sidechannel.send_message(sock, {"type": "offer", "id": "t1"})
    answers.append(sidechannel.expect(sock, "accept", 30)["id"])
    sock.close()

thread = threading.Thread(target=client)
thread.start()
deadline = time.monotonic() + 20
while server.stats.accept_errors < 2 and time.monotonic() < deadline:
    threading.Event().wait(0.01)
errors_while_full = server.stats.accept_errors
for fd in fillers:
    os.close(fd)
thread.join(30)
print(json.dumps({"errors_while_full": errors_while_full, "answers": answers, "stats": vars(server.stats)}))
"""


def test_a_real_emfile_on_accept_is_survived_and_the_waiting_client_served() -> None:
    """The process runs out of file descriptors while a client waits in the backlog; once some are
    free again the same client is accepted, authenticated and answered."""
    result = subprocess.run(
        [sys.executable, "-c", _REAL_EMFILE], capture_output=True, text=True, timeout=90, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["errors_while_full"] >= 2  # it kept retrying, with back-off
    assert seen["answers"] == ["t1"]
    assert seen["stats"]["authenticated"] == 1


def _send_in_background(sock: socket.socket, data: bytes) -> threading.Thread:
    def push() -> None:
        with contextlib.suppress(OSError):  # the server closes on us: expected
            sock.sendall(data)

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    return thread


BIG = 16 << 20


@pytest.mark.parametrize("framing", ["message", "hello-then-junk"])
def test_a_16_mib_first_frame_without_a_valid_mac_is_refused_after_the_pre_auth_limit(serve, framing) -> None:
    server, handle = serve(auth=KEY)
    if framing == "message":  # a client without the key sends one huge message
        data = struct.pack(">I", BIG - 4) + b"[" + b"[]," * ((BIG - 8) // 3)
    else:  # a well-formed hello, then 16 MiB where the MAC should be
        hello = sidechannel.HELLO.pack(
            sidechannel.MAGIC, sidechannel.PROTOCOL_VERSION, sidechannel.FLAG_KEY, bytes(32)
        )
        data = hello + b"x" * BIG
    with socket.create_connection((HOST, server.port), timeout=10) as sock:
        pusher = _send_in_background(sock, data)
        assert _closed_within([sock], 10) == 1
    pusher.join(10)
    assert wait_until(lambda: server.stats.refused == 1)
    assert server.stats.preauth_bytes_max <= PRE_AUTH_LIMIT
    assert handle.calls == 0


def test_without_a_key_a_16_mib_first_message_is_refused_before_its_body_is_read(serve) -> None:
    server, handle = serve()
    hello = sidechannel.HELLO.pack(sidechannel.MAGIC, sidechannel.PROTOCOL_VERSION, 0, bytes(32))
    data = hello + struct.pack(">I", BIG - 4) + b"x" * (BIG - 4)
    with socket.create_connection((HOST, server.port), timeout=10) as sock:
        pusher = _send_in_background(sock, data)
        assert _closed_within([sock], 10) == 1
    pusher.join(10)
    assert wait_until(lambda: bool(handle.errors))
    assert handle.errors == [f"side-channel message of {BIG - 4} bytes exceeds {PRE_AUTH_LIMIT}"]


def test_a_message_trickling_in_times_out_on_the_whole_message_not_per_read() -> None:
    left, right = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        body = json.dumps({"type": "offer", "pad": "x" * 100}).encode()
        for byte in struct.pack(">I", len(body)) + body:
            if stop.wait(0.1):
                return
            left.send(bytes([byte]))

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        sidechannel.recv_message(right, 1.0)
    assert time.monotonic() - started < 3.0
    stop.set()
    thread.join()
    left.close()
    right.close()


@pytest.mark.parametrize(
    "body", [b'{"type":"offer","hold_s":Infinity}', b'{"type":"offer","x":NaN}', b"[" * 100_000, b"\xff\xfe"]
)
def test_non_finite_numbers_deep_nesting_and_bad_utf8_are_refused_as_not_json(body: bytes) -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(TransportError, match="not JSON"):
            sidechannel.recv_message(right, 5)


def test_errors_quote_at_most_a_short_piece_of_the_peers_data() -> None:
    huge = "y" * (1 << 20)
    assert len(str(sidechannel.unexpected({"type": "nack", "reason": huge}, "accept"))) < 1024
    assert len(str(sidechannel.unexpected({"type": huge}, "accept"))) < 1024
    assert len(str(sidechannel.unexpected({"type": "nack", "reason": [[huge]] * 1000}, "accept"))) < 1024
    left, right = socket.socketpair()
    with left, right:
        body = json.dumps([huge] * 4).encode()
        pusher = _send_in_background(left, struct.pack(">I", len(body)) + body)
        with pytest.raises(TransportError) as raised:
            sidechannel.recv_message(right, 10)
        pusher.join(10)
    assert "without a type" in str(raised.value)
    assert len(str(raised.value)) < 1024


def test_refusals_are_logged_in_short_rate_limited_lines(serve, caplog) -> None:
    server, _ = serve(auth=KEY)
    with caplog.at_level(logging.WARNING, logger="dllm_connector.transport.sidechannel"):
        for _ in range(20):
            with pytest.raises(PeerRefused):
                exchange(server, None)
        assert wait_until(lambda: server.stats.refused == 20)
    lines = [record.getMessage() for record in caplog.records]
    assert 1 <= len(lines) < 20
    assert all(len(line) < 300 for line in lines)
    assert "refused a connection from 127.0.0.1:" in lines[0]


def test_tokens_shorter_than_32_characters_are_refused_and_keys_never_shown() -> None:
    with pytest.raises(ValueError, match="at least 32 characters"):
        PeerAuth.from_token("short-token")
    with pytest.raises(ValueError, match="at least 32"):
        PeerAuth(b"k" * 31)
    auth = PeerAuth.from_token(" " + "s" * 40 + "\n")  # a Secret file's trailing newline is not key
    assert auth == PeerAuth.from_token("s" * 40)
    assert "s" * 40 not in repr(auth)


# ---- issue 19: the protocol version travels in every connection's hello -----------------------------

OTHER_VERSION = sidechannel.PROTOCOL_VERSION + 1


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
def test_a_client_of_another_version_is_refused_naming_both_versions(serve, auth, caplog) -> None:
    server, handle = serve(auth=auth)
    before = _connection_threads()
    flags = sidechannel.FLAG_KEY if auth else 0
    with caplog.at_level(logging.WARNING, logger="dllm_connector.transport.sidechannel"):
        with socket.create_connection((HOST, server.port), timeout=5) as sock:
            sock.sendall(sidechannel.HELLO.pack(sidechannel.MAGIC, OTHER_VERSION, flags, bytes(32)))
            raw = sidechannel.read_exactly(sock, sidechannel.CHALLENGE.size, time.monotonic() + 5)
            assert _closed_within([sock], 5) == 1
        assert wait_until(lambda: server.stats.refused == 1)
    _, version, status, nonce, mac = sidechannel.CHALLENGE.unpack(raw)
    assert (version, status) == (sidechannel.PROTOCOL_VERSION, sidechannel.STATUS_BAD_VERSION)
    assert nonce == mac == bytes(32)
    assert (
        f"it speaks protocol version {OTHER_VERSION}, this engine {sidechannel.PROTOCOL_VERSION}"
        in caplog.text
    )
    assert handle.calls == 0
    assert wait_until(lambda: _connection_threads() == before)
    assert exchange(server, auth) == "t1"  # and it still serves its own version


class ServerOfAnotherVersion:
    """Test double: a side channel that answers every hello as one of `version` would, with `status`."""

    def __init__(self, version: int, status: int) -> None:
        self.closed_by_client = threading.Event()
        self._listener = socket.create_server((HOST, 0))
        self.port = int(self._listener.getsockname()[1])
        self._answer = sidechannel.CHALLENGE.pack(sidechannel.MAGIC, version, status, bytes(32), bytes(32))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.settimeout(10)
            sidechannel.read_exactly(conn, sidechannel.HELLO.size, time.monotonic() + 10)
            conn.sendall(self._answer)
            if conn.recv(1) == b"":
                self.closed_by_client.set()

    def close(self) -> None:
        self._listener.close()
        self._thread.join(10)


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
@pytest.mark.parametrize(
    ("version", "status"),
    [(OTHER_VERSION, sidechannel.STATUS_BAD_VERSION), (1, sidechannel.STATUS_NO_AUTH)],
    ids=["newer", "version-1-without-key"],
)
def test_a_server_of_another_version_is_refused_naming_both_versions(auth, version, status) -> None:
    server = ServerOfAnotherVersion(version, status)
    try:
        with pytest.raises(sidechannel.VersionMismatch) as raised:
            sidechannel.connect(HOST, server.port, 5, auth=auth)
        assert server.closed_by_client.wait(10)  # the client closed its end
    finally:
        server.close()
    assert str(raised.value) == (
        f"the KV side channel at {HOST}:{server.port} speaks protocol version {version}, "
        f"this engine {sidechannel.PROTOCOL_VERSION}"
    )


def test_a_client_of_version_1_without_a_key_is_told_both_versions(serve) -> None:
    """Version 1 sent no hello without a key: its first bytes are a message."""
    server, handle = serve()
    with socket.create_connection((HOST, server.port), timeout=5) as sock:
        sidechannel.send_message(sock, {"type": "offer", "id": "t1"})
        both = rf"speaks protocol version {sidechannel.PROTOCOL_VERSION}.*protocol version 1"
        with pytest.raises(PeerRefused, match=both):
            sidechannel.expect(sock, "accept", 5)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0
