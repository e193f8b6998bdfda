"""Prefill's blocks and decode's waiters are not held for transfers decode will never claim (security
review M2, H4): an ended id ends the send waiting on it at once, a peer's hold is clamped to
decode's, and offers waiting for ids decode never expects are not woken by a real transfer.

Real KVSender and KVReceiver over real Mooncake transports and sockets on 127.0.0.1
(hostile_peer_cases.py); a hostile prefill is a scripted double (peer_doubles.py).
"""

from __future__ import annotations

import socket
import time

import hostile_peer_cases
import pytest
from hostile_peer_cases import HASH, HOLD, TIMEOUT, config, send_and_wait
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches
from peer_doubles import fake_prefill, offer_for, wait_until

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.end import EndRefused, end_transfer
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport import sidechannel
from dllm_connector.transport.mooncake import MooncakeTransport

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

receiver = hostile_peer_cases.receiver  # the shared fixtures, collected from this module's names
sender = hostile_peer_cases.sender


# ---- M2 and H4's hold: prefill's blocks are not held when decode will never claim ---------------------


def test_an_ended_id_ends_the_waiting_send_within_the_transfer_timeout(
    receiver: KVReceiver, sender: KVSender
) -> None:
    """Decode refused the request (say, a 400): the router ends its id, and prefill's send, which
    waits for decode to claim it, fails at once instead of holding its blocks for the hold."""
    started = time.monotonic()
    sender.submit(SendJob("m2-wait", (1, 2), HOST, receiver.port, HASH))
    assert wait_until(lambda: sender.in_flight == {"m2-wait"}, 5)
    end_transfer(HOST, receiver.port, "m2-wait", TIMEOUT)
    outcomes: dict[str, str | None] = {}
    assert wait_until(lambda: outcomes.update(sender.finished()) or "m2-wait" in outcomes, 3 * TIMEOUT)
    assert time.monotonic() - started < 3 * TIMEOUT  # not HOLD
    outcome = outcomes["m2-wait"]
    assert outcome is not None
    assert "not awaited any more" in outcome
    assert sender.in_flight == set()


def test_an_id_ended_before_the_offer_is_refused_at_once(receiver: KVReceiver, sender: KVSender) -> None:
    end_transfer(HOST, receiver.port, "m2-early", TIMEOUT)
    outcome, took = send_and_wait(sender, SendJob("m2-early", (1, 2), HOST, receiver.port, HASH), HOLD)
    assert outcome is not None
    assert "not awaited any more" in outcome
    assert took < 3 * TIMEOUT


def test_ending_an_id_decode_expects_changes_nothing(receiver: KVReceiver, sender: KVSender) -> None:
    receiver.expect("m2-mine", [5, 6], prompt_hash=HASH)
    end_transfer(HOST, receiver.port, "m2-mine", TIMEOUT)
    assert receiver.pending == {"m2-mine"}
    outcome, _ = send_and_wait(sender, SendJob("m2-mine", (1, 2), HOST, receiver.port, HASH), HOLD)
    assert outcome is None
    assert receiver.wait_for("m2-mine", 10) == ""


def test_ending_an_id_where_no_decode_listens_says_so() -> None:
    with socket.socket() as unused:
        unused.bind((HOST, 0))
        port = int(unused.getsockname()[1])
    with pytest.raises(EndRefused, match="cannot end transfer"):
        end_transfer(HOST, port, "m2-nobody", TIMEOUT)


def test_the_peers_hold_is_clamped_to_decodes(
    transports: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    receiver = KVReceiver(
        transports[0], PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config(hold_seconds=1), HOST, 0
    )
    try:
        with fake_prefill(receiver.port) as sock:
            started = time.monotonic()
            sidechannel.send_message(sock, offer_for(receiver.kv, "h4-hold", HASH, 2, hold_s=1e9))
            reply = sidechannel.recv_message(sock, 10)
            took = time.monotonic() - started
        assert reply["type"] == "nack"
        assert "within 1.0s" in reply["reason"]
        assert took < 5
    finally:
        receiver.close()


# ---- H4: offers waiting for ids decode never expects do not slow a real transfer --------------------


def test_offers_waiting_for_unknown_ids_are_not_woken_by_a_real_transfer(
    receiver: KVReceiver, sender: KVSender
) -> None:
    waiting = 40  # under the side channel's connection cap, with room for the real transfer
    socks = [sidechannel.connect(HOST, receiver.port, 10) for _ in range(waiting)]
    try:
        for i, sock in enumerate(socks):
            sidechannel.send_message(sock, offer_for(receiver.kv, f"unknown-{i}", HASH, 2))
        receiver.expect("real", [5, 6], prompt_hash=HASH)
        outcome, _ = send_and_wait(sender, SendJob("real", (1, 2), HOST, receiver.port, HASH), HOLD)
        assert outcome is None
        assert receiver.wait_for("real", 10) == ""
        assert receiver.waiter_wakeups <= 2  # the real offer's claim and its outcome's waiter at most
        for i in range(waiting):
            end_transfer(HOST, receiver.port, f"unknown-{i}", TIMEOUT)
        replies = [sidechannel.recv_message(sock, 10) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(reply["type"] == "nack" and "not awaited any more" in reply["reason"] for reply in replies)
    assert receiver.waiter_wakeups <= 2 + waiting  # each ended id woke its own waiter only
    assert receiver.pending == set()
