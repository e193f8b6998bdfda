"""The KV side channel's message framing holds against a hostile peer (H4, L2): a first frame is
refused past the pre-auth limit before its body is read, a message that trickles in times out on
the whole message, non-finite numbers, deep nesting and bad UTF-8 are not JSON, and errors quote
only a short piece of what the peer sent.

Real sockets on 127.0.0.1 (a real Server from sidechannel_cases.py, or a socket pair).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time

import pytest
import sidechannel_cases
from sidechannel_cases import HOST, KEY, Serve, closed_within, wait_until

from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_connector.transport.sidechannel import PRE_AUTH_LIMIT

pytestmark = pytest.mark.timeout(120)

serve = sidechannel_cases.serve  # the shared fixture, collected from this module's names


def _send_in_background(sock: socket.socket, data: bytes) -> threading.Thread:
    def push() -> None:
        with contextlib.suppress(OSError):  # the server closes on us: expected
            sock.sendall(data)

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    return thread


BIG = 16 << 20


@pytest.mark.parametrize("framing", ["message", "hello-then-junk"])
def test_a_16_mib_first_frame_without_a_valid_mac_is_refused_after_the_pre_auth_limit(
    serve: Serve, framing: str
) -> None:
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
        assert closed_within([sock], 10) == 1
    pusher.join(10)
    assert wait_until(lambda: server.stats.refused == 1)
    assert server.stats.preauth_bytes_max <= PRE_AUTH_LIMIT
    assert handle.calls == 0


def test_without_a_key_a_16_mib_first_message_is_refused_before_its_body_is_read(serve: Serve) -> None:
    server, handle = serve()
    hello = sidechannel.HELLO.pack(sidechannel.MAGIC, sidechannel.PROTOCOL_VERSION, 0, bytes(32))
    data = hello + struct.pack(">I", BIG - 4) + b"x" * (BIG - 4)
    with socket.create_connection((HOST, server.port), timeout=10) as sock:
        pusher = _send_in_background(sock, data)
        assert closed_within([sock], 10) == 1
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


def test_bytes_that_arrived_in_time_are_read_by_a_reader_that_wakes_past_its_deadline() -> None:
    """A whole-machine stall (seen on the 2-core test host: every process frozen for 7 s) let a peer's
    hello arrive in time while the reader slept past its deadline; it then closed the connection with
    the hello unread and the transfer failed. What is there is read; what is not is not waited for."""
    left, right = socket.socketpair()
    hello = b"h" * 16
    left.sendall(hello)
    past = time.monotonic() - 1.0  # the reader woke a second after its deadline
    assert sidechannel.read_exactly(right, len(hello), past) == hello
    right.settimeout(7.5)
    left.sendall(hello[:8])  # half: the rest never comes
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        sidechannel.read_exactly(right, len(hello), past)
    assert time.monotonic() - started < 0.5  # nothing waited for past the deadline
    assert right.gettimeout() == 7.5  # the socket's own timeout as it was, for the sends after
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
