"""The KV side channel authenticates both ends before any JSON (C2): the same key on both ends
exchanges, a different or missing key is refused with a reason naming DLLM_KV_AUTH_TOKEN, and the
handler never runs for a peer that did not authenticate.

Real sockets on 127.0.0.1, a real Server and real clients (sidechannel_cases.py).
"""

from __future__ import annotations

import socket
import time

import pytest
import sidechannel_cases
from sidechannel_cases import HOST, KEY, Serve, exchange, wait_until

from dllm_connector.transport import sidechannel
from dllm_connector.transport.sidechannel import AuthenticationFailed, PeerAuth, PeerRefused

pytestmark = pytest.mark.timeout(120)

OTHER_KEY = PeerAuth.from_token("b" * 64)

serve = sidechannel_cases.serve  # the shared fixture, collected from this module's names


def test_the_same_key_on_both_ends_authenticates_and_exchanges(serve: Serve) -> None:
    server, handle = serve(auth=KEY)
    assert exchange(server, KEY) == "t1"
    assert handle.calls == 1
    assert server.stats.authenticated == 1
    assert server.stats.refused == 0


@pytest.mark.parametrize("auth", [KEY, None], ids=["with-key", "without-key"])
def test_after_the_handshake_sockets_have_the_usual_timeouts(serve: Serve, auth: PeerAuth | None) -> None:
    """Not what was left of the handshake's deadline: the client's connect timeout, none on the server."""
    server, handle = serve(auth=auth)
    with sidechannel.connect(HOST, server.port, 7.5, auth=auth) as sock:
        assert sock.gettimeout() == 7.5
        sidechannel.send_message(sock, {"type": "offer", "id": "t1"})
        sidechannel.expect(sock, "accept", 5)
    assert handle.timeouts == [None]


def test_no_key_on_either_end_keeps_todays_behaviour(serve: Serve) -> None:
    server, handle = serve()
    assert exchange(server, None) == "t1"
    assert handle.calls == 1


@pytest.mark.parametrize(("client", "server_key"), [(KEY, OTHER_KEY), (OTHER_KEY, KEY)])
def test_a_different_key_is_refused_and_the_handler_never_runs(
    serve: Serve, client: PeerAuth, server_key: PeerAuth
) -> None:
    server, handle = serve(auth=server_key)
    with pytest.raises(AuthenticationFailed, match="DLLM_KV_AUTH_TOKEN differs"):
        sidechannel.connect(HOST, server.port, 5, auth=client)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0
    assert exchange(server, server_key) == "t1"  # the server is still fine


def test_a_client_that_cannot_answer_the_challenge_is_refused_before_any_json(serve: Serve) -> None:
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


def test_a_client_without_a_key_is_told_that_the_server_requires_one(serve: Serve) -> None:
    server, handle = serve(auth=KEY)
    with pytest.raises(PeerRefused, match=r"requires authentication.*DLLM_KV_AUTH_TOKEN"):
        exchange(server, None)
    assert handle.calls == 0
    assert server.stats.refused == 1


def test_a_client_with_a_key_is_told_that_the_server_has_none(serve: Serve) -> None:
    server, handle = serve()
    with pytest.raises(AuthenticationFailed, match=r"does not authenticate peers.*DLLM_KV_AUTH_TOKEN"):
        sidechannel.connect(HOST, server.port, 5, auth=KEY)
    assert wait_until(lambda: server.stats.refused == 1)
    assert handle.calls == 0


def test_tokens_shorter_than_32_characters_are_refused_and_keys_never_shown() -> None:
    with pytest.raises(ValueError, match="at least 32 characters"):
        PeerAuth.from_token("short-token")
    with pytest.raises(ValueError, match="at least 32"):
        PeerAuth(b"k" * 31)
    auth = PeerAuth.from_token(" " + "s" * 40 + "\n")  # a Secret file's trailing newline is not key
    assert auth == PeerAuth.from_token("s" * 40)
    assert "s" * 40 not in repr(auth)
