"""The KV side channel survives peers that flood it (H4, L2, NEW-7): silent connections are held to
the pre-authentication pool (the oldest evicted for a newer one) and closed by the handshake's
deadline, running out of file descriptors on accept does not end the listener, and a stream of
refused peers gets only a few short log lines.

Real sockets on 127.0.0.1, a real Server and real clients (sidechannel_cases.py); the only stand-in
is the one accept() failure of the EMFILE test, injected where the listener's accept is called.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import subprocess
import sys
import time

import pytest
import sidechannel_cases
from sidechannel_cases import HOST, KEY, Serve, closed_within, connection_threads, exchange, wait_until

from dllm_connector.transport.sidechannel import PeerAuth, PeerRefused, Server

pytestmark = pytest.mark.timeout(120)

serve = sidechannel_cases.serve  # the shared fixture, collected from this module's names


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
def test_500_silent_connections_hold_at_most_the_pre_auth_pool_and_all_close_by_the_deadline(
    serve: Serve, auth: PeerAuth | None
) -> None:
    cap, deadline_s = 16, 1.0
    server, handle = serve(auth=auth, pre_auth_connections=cap, handshake_timeout=deadline_s)
    before = connection_threads()
    socks: list[socket.socket] = []
    most = 0
    try:
        for _ in range(500):
            socks.append(socket.create_connection((HOST, server.port), timeout=5))
            most = max(most, connection_threads())
        started = time.monotonic()
        assert closed_within(socks, deadline_s + 10) == 500
        elapsed = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
    assert most - before <= cap + 4  # the pool, and evicted threads in their last lines
    assert elapsed < deadline_s + 10
    stats = server.stats
    assert stats.accepted == 500
    assert stats.evicted > 0  # newer connections made room by closing the oldest
    assert stats.evicted + stats.timed_out == 500
    assert handle.calls == 0
    assert wait_until(lambda: connection_threads() == before)
    assert exchange(server, auth) == "t1"  # and it still serves


def test_accept_failing_with_emfile_once_does_not_end_the_listener(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_refusals_are_logged_in_short_rate_limited_lines(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
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
