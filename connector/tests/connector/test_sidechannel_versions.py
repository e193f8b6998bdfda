"""Side channels of different protocol versions refuse each other, naming both versions (issue 19):
the version travels in every connection's hello, with or without a key, and a version-1 client that
sends no hello is told both too.

Real sockets on 127.0.0.1, a real Server and real clients (sidechannel_cases.py); a server of
another version is a scripted double (ServerOfAnotherVersion).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import sidechannel_cases
from sidechannel_cases import HOST, KEY, Serve, closed_within, connection_threads, exchange, wait_until

from dllm_connector.transport import sidechannel
from dllm_connector.transport.sidechannel import PeerAuth, PeerRefused

pytestmark = pytest.mark.timeout(120)

serve = sidechannel_cases.serve  # the shared fixture, collected from this module's names

OTHER_VERSION = sidechannel.PROTOCOL_VERSION + 1


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
def test_a_client_of_another_version_is_refused_naming_both_versions(
    serve: Serve, auth: PeerAuth | None, caplog: pytest.LogCaptureFixture
) -> None:
    server, handle = serve(auth=auth)
    before = connection_threads()
    flags = sidechannel.FLAG_KEY if auth else 0
    with caplog.at_level(logging.WARNING, logger="dllm_connector.transport.sidechannel"):
        with socket.create_connection((HOST, server.port), timeout=5) as sock:
            sock.sendall(sidechannel.HELLO.pack(sidechannel.MAGIC, OTHER_VERSION, flags, bytes(32)))
            raw = sidechannel.read_exactly(sock, sidechannel.CHALLENGE.size, time.monotonic() + 5)
            assert closed_within([sock], 5) == 1
        assert wait_until(lambda: server.stats.refused == 1)
    _, version, status, nonce, mac = sidechannel.CHALLENGE.unpack(raw)
    assert (version, status) == (sidechannel.PROTOCOL_VERSION, sidechannel.STATUS_BAD_VERSION)
    assert nonce == mac == bytes(32)
    assert (
        f"it speaks protocol version {OTHER_VERSION}, this engine {sidechannel.PROTOCOL_VERSION}"
        in caplog.text
    )
    assert handle.calls == 0
    assert wait_until(lambda: connection_threads() == before)
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
def test_a_server_of_another_version_is_refused_naming_both_versions(
    auth: PeerAuth | None, version: int, status: int
) -> None:
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


def test_a_client_of_version_1_without_a_key_is_told_both_versions(serve: Serve) -> None:
    """Version 1 sent no hello without a key: its first bytes are a message."""
    server, handle = serve()
    with socket.create_connection((HOST, server.port), timeout=5) as sock:
        sidechannel.send_message(sock, {"type": "offer", "id": "t1"})
        both = rf"speaks protocol version {sidechannel.PROTOCOL_VERSION}.*protocol version 1"
        with pytest.raises(PeerRefused, match=both):
            sidechannel.expect(sock, "accept", 5)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0
