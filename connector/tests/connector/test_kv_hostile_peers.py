"""A broken or hostile peer's malformed messages on the KV side channel end the transfer with a
short reason, in bounded time (security review H6, L3, L2, M7): a malformed accept, slot or chunk,
an offer with bad fields or another prompt, a store off the peer, and what a peer can make decode
log or tell.

Real KVSender and KVReceiver over real Mooncake transports and sockets on 127.0.0.1
(hostile_peer_cases.py); the other end is a scripted double (peer_doubles.py).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from typing import Any

import hostile_peer_cases
import pytest
from hostile_peer_cases import HASH, HOLD, TIMEOUT, config, send_and_wait
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches
from peer_doubles import FakeDecode, fake_prefill, offer_for, read_until_closed

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport import sidechannel
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

receiver = hostile_peer_cases.receiver  # the shared fixtures, collected from this module's names
sender = hostile_peer_cases.sender


# ---- H6: prefill facing a fake decode -------------------------------------------------------------


def answering(*replies: dict[str, Any]) -> FakeDecode:
    """A fake decode that reads the offer, sends `replies`, then reads whatever comes until closed."""

    def script(sock: socket.socket) -> None:
        sidechannel.recv_message(sock, 10)
        for reply in replies:
            sidechannel.send_message(sock, reply)
        read_until_closed(sock, 30)

    return FakeDecode(script)


@pytest.mark.parametrize(
    "reply",
    [
        {"type": "accept"},
        {"type": "accept", "skip": 0, "count": 2, "dst": "x"},
        {"type": "accept", "skip": [0], "count": 2},
        {"type": "accept", "skip": 0, "count": 99},  # more blocks than prefill offered
        {"type": "accept", "skip": 0, "count": 2, "slots": [[5, 4096]]},  # a slot past the last chunk
    ],
    ids=["bare", "dst-not-spans", "skip-a-list", "count-too-big", "slot-out-of-range"],
)
def test_a_malformed_accept_fails_the_send_within_the_transfer_timeout(
    sender: KVSender, reply: dict[str, Any]
) -> None:
    decode = answering(reply)
    try:
        outcome, took = send_and_wait(sender, SendJob("h6-accept", (1, 2), HOST, decode.port, HASH), HOLD)
    finally:
        decode.close()
    assert outcome is not None
    assert "accept" in outcome or "decode accepted" in outcome or "slot" in outcome
    assert took < 3 * TIMEOUT  # not the hold
    assert sender.in_flight == set()
    assert sender.stats.failed_sends == 1


def zero_copy_accept(sender: KVSender, **changes: Any) -> dict[str, Any]:
    """A well-formed zero-copy accept of 2 blocks naming the sender's own cache's layout, then `changes`."""
    where = sender.kv.addresses()
    dst = {
        "layers": [[a.base, a.block_stride, a.segment_stride] for a in where.layers],
        "segments": where.segments,
        "runs": [list(run) for run in where.runs],
        "blocks": [3, 4],
    }
    return {"type": "accept", "skip": 0, "count": 2, "dst": dst | changes, "zero_copy": True}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"runs": [[n, 1] for n in range(1 << 16)]}, "runs of other lengths"),  # a 10 GB span table
        ({"layers": [[(1 << 63) - 64, 1 << 20, 0]] * 2}, "past the 64-bit address space"),
        ({"layers": [[1 << 40, 1 << 40, 0]] * 2, "blocks": [3, 1 << 24]}, "past the 64-bit address space"),
    ],
    ids=["65536-tiny-runs", "base-near-2^63", "a-far-block"],
)
def test_a_zero_copy_accept_whose_addresses_cannot_be_this_caches_fails_before_any_span_is_made(
    sender: KVSender, changes: dict[str, Any], reason: str
) -> None:
    """gpu-review item 14: the sender works decode's spans out as arrays of layers x blocks x segments x
    runs, so the runs a decode names are checked first (their lengths must be this cache's own, which
    bounds the table by this side's), and so are addresses that would pass 2^63 in int64."""
    assert sender.zero_copy
    if "layers" in changes:
        changes["layers"] = changes["layers"][:1] * sender.kv.num_layers
    decode = answering(zero_copy_accept(sender, **changes))
    try:
        outcome, took = send_and_wait(sender, SendJob("h6-dst", (1, 2), HOST, decode.port, HASH), HOLD)
    finally:
        decode.close()
    assert outcome is not None
    assert reason in outcome, outcome
    assert took < 3 * TIMEOUT
    assert sender.in_flight == set()
    assert sender.stats.sent == 0


def test_a_malformed_slot_message_fails_the_send(sender: KVSender) -> None:
    """fp8 goes through decode's staging: a slot naming a list for an address ends the send."""
    sender.config = config(compression=Compression.FP8)
    decode = answering({"type": "accept", "skip": 0, "count": 2}, {"type": "slot", "index": 0, "addr": [1]})
    try:
        outcome, took = send_and_wait(sender, SendJob("h6-slot", (1, 2), HOST, decode.port, HASH), HOLD)
    finally:
        decode.close()
    assert outcome is not None
    assert "malformed slot message" in outcome
    assert took < 3 * TIMEOUT
    assert sender.in_flight == set()


# ---- H6: decode facing a fake prefill -------------------------------------------------------------


def test_a_malformed_chunk_after_a_claim_fails_the_load(receiver: KVReceiver) -> None:
    receiver.expect("h6-chunk", [3, 4], prompt_hash=HASH)
    with fake_prefill(receiver.port) as sock:
        sidechannel.send_message(sock, offer_for(receiver.kv, "h6-chunk", HASH, 2))
        assert sidechannel.recv_message(sock, 10)["type"] == "accept"
        sidechannel.send_message(sock, {"type": "chunk", "index": [0]})
        started = time.monotonic()
        outcome = receiver.wait_for("h6-chunk", 3 * TIMEOUT)
        assert outcome is not None
        assert "malformed chunk message" in outcome
        assert time.monotonic() - started < 3 * TIMEOUT
        assert [m["type"] for m in read_until_closed(sock, 5)] == ["nack"]
    assert not receiver.pending
    assert receiver.staging.in_use == 0


def test_a_chunk_header_with_another_dtype_fails_cleanly(
    transports: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    """Two-sided transports read the payload the header describes: a float32 header for a bf16
    cache is refused by decode before anything is received or decoded."""
    from dllm_connector.transport.torchdist import TorchDistTransport

    gloo = TorchDistTransport(HOST, backend="gloo", connect_timeout=5)
    receiver = KVReceiver(gloo, PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config(), HOST, 0)
    try:
        receiver.expect("h6-dtype", [3, 4], prompt_hash=HASH)
        with fake_prefill(receiver.port) as sock:
            # The store must be on the side channel's peer address (M7), the fake's own 127.0.0.1.
            endpoint = {"store": f"{HOST}:1", "pair": "fake-pair-1"}
            sidechannel.send_message(sock, offer_for(receiver.kv, "h6-dtype", HASH, 2, endpoint=endpoint))
            assert sidechannel.recv_message(sock, 10)["type"] == "accept"
            shape = list(receiver.kv.batch_shape(2))
            header = {"v": 2, "codec": "none", "dtype": "float32", "shape": shape, "groups": 1, "checksum": 0}
            sidechannel.send_message(sock, {"type": "chunk", "index": 0, "header": header})
            nack = sidechannel.recv_message(sock, 10)  # told at once, before the payload
            assert nack["type"] == "nack"
            assert "does not match this cache's layout" in nack["reason"]
            sidechannel.send_message(sock, {"type": "abort", "reason": "stopped as told"})
            outcome = receiver.wait_for("h6-dtype", 3 * TIMEOUT)
        assert outcome is not None
        assert "does not match this cache's layout" in outcome
        assert receiver.staging.in_use == 0
        assert not receiver.pending
        assert not bool(receiver.kv.gather([3, 4]).any())
    finally:
        receiver.close()
        gloo.close()


def test_a_two_sided_offer_naming_a_store_off_its_peer_is_refused() -> None:
    """M7: decode joins only a TCPStore on the address its side channel came from."""
    from dllm_connector.transport.torchdist import TorchDistTransport

    gloo = TorchDistTransport(HOST, backend="gloo", connect_timeout=5, require_admission=True)
    receiver = KVReceiver(gloo, PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config(), HOST, 0)
    try:
        receiver.expect("m7", [3, 4], prompt_hash=HASH)
        with fake_prefill(receiver.port) as sock:
            endpoint = {"store": "10.9.9.9:29500", "pair": "fake-pair-2"}
            sidechannel.send_message(sock, offer_for(receiver.kv, "m7", HASH, 2, endpoint=endpoint))
            nack = sidechannel.recv_message(sock, 10)
        assert nack["type"] == "nack"
        assert "not on its side-channel peer" in nack["reason"]
        assert "m7" in receiver.pending, "the expectation waits for a genuine prefill"
    finally:
        receiver.close()
        gloo.close()


# ---- L3: offers decode refuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"prompt_hash": None}, "prompt_hash"),
        ({"chunk_blocks": 0}, "chunk_blocks"),
        ({"chunk_blocks": -4}, "chunk_blocks"),
        ({"chunk_blocks": [1]}, "chunk_blocks"),
        ({"hold_s": float("inf")}, "hold_s|not JSON"),  # the side channel may refuse it first
        ({"hold_s": -1}, "hold_s"),
        ({"num_blocks": "2"}, ""),  # lax: "2" is 2, a well-formed offer
    ],
    ids=["no-prompt-hash", "chunk-0", "chunk-negative", "chunk-list", "hold-infinity", "hold-negative", "ok"],
)
def test_offers_with_bad_fields_are_nacked_before_anything_is_claimed(
    receiver: KVReceiver, changes: dict[str, Any], reason: str
) -> None:
    receiver.expect("l3", [3, 4], prompt_hash=HASH)
    offer = offer_for(receiver.kv, "l3", HASH, 2) | changes
    if offer["prompt_hash"] is None:
        del offer["prompt_hash"]
    with fake_prefill(receiver.port) as sock:
        sidechannel.send_message(sock, offer)  # json.dumps writes inf as Infinity, as a peer may
        reply = sidechannel.recv_message(sock, 10)
        if not reason:
            assert reply["type"] == "accept"
            sidechannel.send_message(sock, {"type": "abort", "reason": "test"})
            assert receiver.wait_for("l3", 10) is not None
            return
        assert reply["type"] == "nack"
        assert any(
            f"malformed offer message from the peer: {field}" in reply["reason"] or field in reply["reason"]
            for field in reason.split("|")
        )
    assert receiver.pending == {"l3"}  # nothing claimed: the real prefill may still come


def test_a_prompt_hash_that_differs_or_is_empty_is_refused(receiver: KVReceiver) -> None:
    for transfer_id, theirs in [("l3-other", prompt_hash([9])), ("l3-empty", "")]:
        receiver.expect(transfer_id, [3, 4], prompt_hash=HASH)
        with fake_prefill(receiver.port) as sock:
            sidechannel.send_message(sock, offer_for(receiver.kv, transfer_id, theirs, 2))
            reply = sidechannel.recv_message(sock, 10)
        assert reply["type"] == "nack"
        assert "prompt token ids differ" in reply["reason"]
        outcome = receiver.wait_for(transfer_id, 10)
        assert outcome is not None
        assert "prompt token ids differ" in outcome


# ---- L2: what a peer can make decode log or tell -----------------------------------------------------


def test_a_huge_signature_is_neither_echoed_nor_answered_with_decodes_own(
    receiver: KVReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.expect("l2", [3, 4], prompt_hash=HASH)
    # 60 kB: under the side channel's limit for a first message, so the offer itself is read
    signature = receiver.kv.signature() | {"model": "m" * 60_000, "dtype": "x" * 3000}
    caplog.set_level(logging.DEBUG)
    with fake_prefill(receiver.port) as sock:
        sidechannel.send_message(sock, offer_for(receiver.kv, "l2", HASH, 2, signature=signature))
        reply = sidechannel.recv_message(sock, 10)
    assert reply["type"] == "nack"
    assert len(json.dumps(reply)) < 1024
    assert "dtype, model" in reply["reason"]  # which fields differ ...
    assert GEOMETRY.model not in reply["reason"]
    assert "bfloat16" not in reply["reason"]
    outcome = receiver.wait_for("l2", 10)
    assert outcome is not None
    assert len(outcome) < 1024
    assert caplog.records
    assert all(len(record.getMessage()) < 1024 for record in caplog.records)


def test_a_garbage_first_message_is_refused_with_a_short_nack(receiver: KVReceiver) -> None:
    with fake_prefill(receiver.port) as sock:
        sidechannel.send_message(sock, {"type": "x" * 100_000, "junk": list(range(10_000))})
        reply = sidechannel.recv_message(sock, 10)
    assert reply["type"] == "nack"
    assert len(json.dumps(reply)) < 1024


def test_a_peer_that_is_not_json_is_dropped(receiver: KVReceiver) -> None:
    with fake_prefill(receiver.port) as sock:
        sock.sendall(struct.pack(">I", 5) + b"nope!")
        messages = read_until_closed(sock, 10)
    assert all(m["type"] == "nack" for m in messages)
    assert not receiver.pending
