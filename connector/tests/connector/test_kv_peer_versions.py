"""KV engines of different protocol versions refuse each other at once, naming both versions (issue
19): a send to a decode of another version fails without a retry, a prefill of another version or
one that sends no hello is refused, and the refused peer claims nothing.

Real KVSender and KVReceiver over real Mooncake transports and sockets on 127.0.0.1
(hostile_peer_cases.py); a decode of another version is a scripted double (peer_doubles.py).
"""

from __future__ import annotations

import logging
import socket
import time

import hostile_peer_cases
import pytest
from hostile_peer_cases import HASH, HOLD, TIMEOUT, send_and_wait
from kv_peer import HOST
from peer_doubles import FakeDecode, offer_for, read_until_closed, wait_until

from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport import sidechannel

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

receiver = hostile_peer_cases.receiver  # the shared fixtures, collected from this module's names
sender = hostile_peer_cases.sender


# ---- issue 19: engines of different protocol versions refuse each other, naming both ---------------

OTHER_VERSION = sidechannel.PROTOCOL_VERSION + 1


def test_a_decode_of_another_version_fails_the_send_at_once_naming_both(sender: KVSender) -> None:
    decode = FakeDecode(lambda sock: None, version=OTHER_VERSION)
    try:
        outcome, took = send_and_wait(sender, SendJob("v-decode", (1, 2), HOST, decode.port, HASH), HOLD)
    finally:
        decode.close()
    assert outcome == (
        f"the KV side channel at {HOST}:{decode.port} speaks protocol version {OTHER_VERSION}, "
        f"this engine {sidechannel.PROTOCOL_VERSION}"
    )
    assert decode.connections == 1  # not retried: the answer would not change
    assert took < 3 * TIMEOUT
    assert sender.in_flight == set()
    assert sender.staging.in_use == 0


def test_a_prefill_of_another_version_is_refused_and_the_expectation_left_alone(
    receiver: KVReceiver, sender: KVSender, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.expect("v-prefill", [5, 6], prompt_hash=HASH)
    hello = sidechannel.HELLO.pack(sidechannel.MAGIC, OTHER_VERSION, 0, bytes(32))
    with caplog.at_level(logging.WARNING, logger="dllm_connector.transport.sidechannel"):
        with socket.create_connection((HOST, receiver.port), timeout=10) as sock:
            sock.sendall(hello)
            answer = sidechannel.read_exactly(sock, sidechannel.CHALLENGE.size, time.monotonic() + 10)
            _, version, status, _, _ = sidechannel.CHALLENGE.unpack(answer)
            assert sock.recv(1) == b""  # and closed
        assert wait_until(lambda: "speaks protocol version" in caplog.text, 10)
    assert (version, status) == (sidechannel.PROTOCOL_VERSION, sidechannel.STATUS_BAD_VERSION)
    assert (
        f"it speaks protocol version {OTHER_VERSION}, this engine {sidechannel.PROTOCOL_VERSION}"
        in caplog.text
    )
    assert receiver.pending == {"v-prefill"}  # the refused peer claimed nothing
    assert receiver.staging.in_use == 0
    outcome, _ = send_and_wait(sender, SendJob("v-prefill", (1, 2), HOST, receiver.port, HASH), HOLD)
    assert outcome is None  # a peer of the same version still loads it
    assert receiver.wait_for("v-prefill", 10) == ""


def test_a_prefill_that_sends_no_hello_is_told_both_versions(receiver: KVReceiver) -> None:
    """An engine of protocol version 1 without a key starts with its offer, not a hello."""
    with socket.create_connection((HOST, receiver.port), timeout=10) as sock:
        sidechannel.send_message(sock, offer_for(receiver.kv, "v1-offer", HASH, 2))
        messages = read_until_closed(sock, 10)
    assert [m["type"] for m in messages] == ["nack"]
    reason = messages[0]["reason"]
    assert f"speaks protocol version {sidechannel.PROTOCOL_VERSION}" in reason
    assert "protocol version 1" in reason
    assert not receiver.pending
