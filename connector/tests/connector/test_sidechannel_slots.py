"""The side channel's two pools (NEW-7): sockets that never authenticate cannot keep an authenticated
peer out, and a server whose slots are all busy says "full" at the hello, which the client can tell
from an authentication failure.

Real sockets on 127.0.0.1 (ports from the OS), a real Server and real clients (sidechannel_cases.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import sidechannel_cases
from sidechannel_cases import HOST, KEY, Serve, exchange, wait_until

from dllm_connector.transport import sidechannel
from dllm_connector.transport.sidechannel import PeerAuth, Server, ServerFull, connections_for

pytestmark = pytest.mark.timeout(60)

serve = sidechannel_cases.serve  # the shared fixture, collected from this module's names

POOL = 4
# Far above what any step here takes: an offer that succeeds did so because the pool made room, not
# because a silent socket reached its deadline.
LONG_HANDSHAKE_S = 60.0


def _silent(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=10)


def _hello_then_silent(port: int) -> socket.socket:
    """Says hello as a client with a key would, reads the challenge, and never answers it."""
    sock = _silent(port)
    nonce = bytes(sidechannel.handshake.NONCE_BYTES)
    sock.sendall(
        sidechannel.HELLO.pack(sidechannel.MAGIC, sidechannel.PROTOCOL_VERSION, sidechannel.FLAG_KEY, nonce)
    )
    sidechannel.read_exactly(sock, sidechannel.CHALLENGE.size, time.monotonic() + 10)
    return sock


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for sock in held:
        sock.close()


@pytest.mark.parametrize("attacker", [_silent, _hello_then_silent], ids=["silent", "hello-then-silent"])
def test_unauthenticated_sockets_filling_the_pre_auth_pool_do_not_stop_an_authenticated_offer(
    serve: Serve, sockets: list[socket.socket], attacker: object
) -> None:
    server, handle = serve(auth=KEY, pre_auth_connections=POOL, handshake_timeout=LONG_HANDSHAKE_S)
    assert callable(attacker)
    sockets.extend(attacker(server.port) for _ in range(POOL))
    assert wait_until(lambda: server.stats.accepted == POOL)
    started = time.monotonic()
    assert exchange(server, KEY) == "t1"
    assert time.monotonic() - started < LONG_HANDSHAKE_S / 4
    stats = server.stats
    assert (stats.evicted, stats.authenticated, handle.calls) == (1, 1, 1)
    assert stats.full == 0  # none of the attackers took a slot past the handshake


def test_a_hello_to_a_server_with_every_slot_busy_is_answered_full_then_served_once_one_frees(
    sockets: list[socket.socket],
) -> None:
    release = threading.Event()

    def hold_the_slot(sock: socket.socket) -> None:
        sidechannel.send_message(sock, {"type": "accept", "id": "held"})
        release.wait(30)

    server = Server(HOST, 0, hold_the_slot, auth=KEY, max_connections=1)
    try:
        sockets.append(sidechannel.connect(HOST, server.port, 5, auth=KEY))
        assert sidechannel.expect(sockets[0], "accept", 5)["id"] == "held"
        for auth in (KEY, PeerAuth.from_token("b" * 64), None):  # told before any key is checked
            with pytest.raises(ServerFull, match="is full"):
                sidechannel.connect(HOST, server.port, 5, auth=auth)
        assert server.stats.full == 3
        assert server.stats.refused == 0
        release.set()
        assert wait_until(lambda: _connects(server))
    finally:
        release.set()
        server.close()


def _connects(server: Server) -> bool:
    try:
        sidechannel.connect(HOST, server.port, 5, auth=KEY).close()
    except ServerFull:
        return False
    return True


@pytest.mark.parametrize(
    ("max_num_seqs", "prefill_tp", "slots"),
    [
        (256, 1, 256),
        (256, 4, 1024),
        (8, 2, sidechannel.MIN_CONNECTIONS),
        (None, 8, sidechannel.MIN_CONNECTIONS),
    ],
)
def test_slots_past_the_handshake_follow_max_num_seqs_times_prefill_tp_above_a_floor(
    max_num_seqs: int | None, prefill_tp: int, slots: int
) -> None:
    assert connections_for(max_num_seqs, prefill_tp) == slots


def test_an_end_asked_of_a_full_side_channel_is_asked_again_until_a_slot_frees(
    sockets: list[socket.socket],
) -> None:
    """The router's end (and the KV check's record query) reach decode's side channel through the
    same slots as offers: one that finds them all busy waits for a slot within its timeout instead of
    failing at once (NEW-7), and one that never gets one fails naming the full side channel."""
    from dllm_connector.pipe.end import EndRefused, end_transfer
    from dllm_connector.pipe.messages import Ack, dump

    release = threading.Event()
    ended: list[str] = []

    def serve_one(sock: socket.socket) -> None:
        message = sidechannel.recv_message(sock, 5)
        if message["type"] == "end":
            ended.append(str(message["transfer_id"]))
            sidechannel.send_message(sock, dump(Ack(type="ack")))
            return
        sidechannel.send_message(sock, {"type": "accept", "id": "held"})
        release.wait(30)

    server = Server(HOST, 0, serve_one, auth=KEY, max_connections=1)
    try:
        sockets.append(sidechannel.connect(HOST, server.port, 5, auth=KEY))
        sidechannel.send_message(sockets[0], {"type": "hold"})
        assert sidechannel.expect(sockets[0], "accept", 5)["id"] == "held"
        with pytest.raises(EndRefused, match="is full"):
            end_transfer(HOST, server.port, "never-0-0123456789ab", 0.3, auth=KEY)
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        end_transfer(HOST, server.port, "tid-0-0123456789ab", 10, auth=KEY)
        assert ended == ["tid-0-0123456789ab"]
        assert 0.3 <= time.monotonic() - started < 5
        assert server.stats.full >= 2  # the first end's tries, and the second's before the slot freed
    finally:
        release.set()
        server.close()
