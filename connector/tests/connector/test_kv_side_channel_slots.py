"""Prefill offers waiting for decode to claim them fit decode's side channel, and a full one delays a
send instead of failing it (NEW-7): the slots are sized from max_num_seqs x prefill TP, and a sender
told "full" asks again with backoff until the transfer timeout, then fails saying so. Both ends hold
the side channel's key, as deployed: every offer is authenticated before it takes a slot.

Real KVSender and KVReceiver over real Mooncake transports and sockets on 127.0.0.1 (ports from the
OS); the prefill connection that holds a slot is a scripted double (peer_doubles.fake_prefill's kind).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from hostile_peer_cases import HASH, config, send_and_wait
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches
from peer_doubles import offer_for, wait_until

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport import sidechannel
from dllm_connector.transport.mooncake import MooncakeTransport

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

BURST = 100  # more than the 64 slots the side channel had before it was sized
KEY = sidechannel.PeerAuth.from_token(secrets.token_hex(32))  # the per-CR Secret's kv-token
SOURCE = (1, 2)

Receivers = Callable[[int], KVReceiver]
Senders = Callable[[int], KVSender]


@pytest.fixture
def receivers(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[Receivers]:
    """Starts decode sides with this many side-channel slots; closes them after the test."""
    started: list[KVReceiver] = []

    def start(max_connections: int) -> KVReceiver:
        kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
        receiver = KVReceiver(transports[0], kv, config(), HOST, 0, auth=KEY, max_connections=max_connections)
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.close()


@pytest.fixture
def senders(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[Senders]:
    """Starts prefill sides with this transfer timeout (ms); closes them after the test."""
    started: list[KVSender] = []

    def start(timeout_ms: int) -> KVSender:
        sender = KVSender(
            transports[1],
            PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY),
            config(transfer_timeout_ms=timeout_ms),
            auth=KEY,
        )
        started.append(sender)
        return sender

    yield start
    for sender in started:
        assert sender.close(timeout=30)


def test_100_offers_waiting_for_their_claims_are_all_loaded_once_decode_expects_them(
    receivers: Receivers, senders: Senders
) -> None:
    receiver = receivers(sidechannel.connections_for(max_num_seqs=128, senders_per_request=1))
    sender = senders(10_000)
    for index in range(BURST):
        sender.submit(SendJob(f"burst-{index}", SOURCE, HOST, receiver.port, HASH))
    assert wait_until(lambda: receiver.offers_waiting == BURST, 60)  # each holds its connection
    targets = {f"burst-{index}": [3 + 2 * index, 4 + 2 * index] for index in range(BURST)}
    for transfer_id, blocks in targets.items():
        receiver.expect(transfer_id, blocks, prompt_hash=HASH)
    outcomes: dict[str, str | None] = {}
    assert wait_until(lambda: outcomes.update(sender.finished()) or len(outcomes) == BURST, 120)
    assert outcomes == dict.fromkeys(targets)
    assert all(receiver.wait_for(transfer_id, 10) == "" for transfer_id in targets)
    assert receiver.side_channel.full == 0
    assert receiver.side_channel.authenticated >= BURST
    assert sender.stats.failed_sends == 0
    sent = sender.kv.gather(SOURCE)
    assert all(torch.equal(receiver.kv.gather(blocks), sent) for blocks in targets.values())


@contextlib.contextmanager
def the_only_slot_held(receiver: KVReceiver) -> Iterator[socket.socket]:
    """A prefill double's offer for an id decode does not expect yet ("holder"): it waits, holding the
    receiver's only slot, until the block ends."""
    with sidechannel.connect(HOST, receiver.port, 10, auth=KEY) as holder:
        sidechannel.send_message(holder, offer_for(receiver.kv, "holder", HASH, len(SOURCE)))
        assert wait_until(lambda: receiver.offers_waiting == 1, 10)
        yield holder


def test_a_full_side_channel_is_asked_again_and_the_send_succeeds_once_a_slot_frees(
    receivers: Receivers, senders: Senders
) -> None:
    receiver, sender = receivers(1), senders(20_000)
    with the_only_slot_held(receiver) as holder:
        receiver.expect("queued", [5, 6], prompt_hash=HASH)
        sender.submit(SendJob("queued", SOURCE, HOST, receiver.port, HASH))
        assert wait_until(lambda: receiver.side_channel.full >= 2, 10)  # refused, and asked again
        assert sender.in_flight == {"queued"}
        receiver.expect("holder", [7, 8], prompt_hash=HASH)  # claimed: decode accepts...
        assert sidechannel.expect(holder, "accept", 10)["type"] == "accept"
    # ...and the holder leaves instead of sending: its part fails, and its slot is free
    outcomes: dict[str, str | None] = {}
    assert wait_until(lambda: outcomes.update(sender.finished()) or "queued" in outcomes, 30)
    assert outcomes["queued"] is None
    assert receiver.wait_for("queued", 10) == ""
    assert torch.equal(receiver.kv.gather([5, 6]), sender.kv.gather(SOURCE))


def test_a_side_channel_full_for_the_whole_transfer_timeout_fails_the_send_saying_so(
    receivers: Receivers, senders: Senders
) -> None:
    receiver, sender = receivers(1), senders(1000)
    with the_only_slot_held(receiver):
        started = time.monotonic()
        outcome, took = send_and_wait(sender, SendJob("never-room", SOURCE, HOST, receiver.port, HASH), 10)
    assert outcome is not None
    assert "is full" in outcome
    assert "for the whole transfer timeout (1.0s)" in outcome
    assert 0.9 <= took < 3.0  # retried up to the timeout, not past it
    assert time.monotonic() - started < 10
    assert receiver.side_channel.full >= 2
    assert sender.stats.timeouts == 1
