"""A broken or hostile peer on the KV side channel ends the transfer with a reason, in bounded time,
and learns and floods nothing (security review H6, M2, L2, L3, H4's hold).

Real KVSender and KVReceiver over real Mooncake transports and sockets on 127.0.0.1; the other end
is a scripted double (peer_doubles.py) where the test needs a peer that misbehaves.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, pipe_config
from peer_doubles import FakeDecode, fake_prefill, offer_for, read_until_closed, wait_until

from dllm_connector import codec
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.end import EndRefused, end_transfer
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport import sidechannel
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

TIMEOUT_MS = 2000  # transfer_timeout_ms of both sides
TIMEOUT = TIMEOUT_MS / 1000
HOLD_SECONDS = 30  # hold_seconds: every bound below is far under it
HOLD = float(HOLD_SECONDS)
HASH = prompt_hash([1, 2, 3])


def config(**changes: Any) -> PipeConfig:
    base = {
        "buffer_size_gb": gb(16 << 20),
        "transfer_timeout_ms": TIMEOUT_MS,
        "prefill_wait_ms": HOLD_SECONDS * 1000,
        "hold_seconds": HOLD_SECONDS,
    }
    return pipe_config(**(base | changes))


@pytest.fixture
def receiver(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVReceiver]:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transports[0], kv, config(), HOST, 0)
    yield receiver
    receiver.close()
    assert receiver.staging.in_use == 0


@pytest.fixture
def sender(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVSender]:
    kv = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    sender = KVSender(transports[1], kv, config())
    yield sender
    assert sender.close(timeout=30)
    assert sender.staging.in_use == 0


def send_and_wait(sender: KVSender, job: SendJob, within: float) -> tuple[str | None, float]:
    """Submit `job`; its outcome and how long it took (fails the test past `within` seconds)."""
    started = time.monotonic()
    sender.submit(job)
    outcomes: dict[str, str | None] = {}
    assert wait_until(lambda: outcomes.update(sender.finished()) or job.transfer_id in outcomes, within)
    return outcomes[job.transfer_id], time.monotonic() - started


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


def test_received_scales_that_are_not_finite_are_refused() -> None:
    """A forger can compute the checksum: a NaN or inf scale is still never decoded into the cache."""
    values = torch.randn(2, 4, 16, 64).to(torch.bfloat16)
    for codec_used in (Compression.FP8, Compression.INT8):
        header, payload = codec.encode(values, codec_used, groups=4)
        for bad in (float("nan"), float("inf"), 0.0, -1.0):
            forged = payload.clone()
            scales = forged[header.data_nbytes :].view(torch.float32)
            scales[1] = bad
            forged_header = codec.KVHeader(
                header.codec, header.dtype, header.shape, header.groups, codec.checksum(header, forged)
            )
            with pytest.raises(codec.CodecError, match="scales are not all finite, positive"):
                list(codec.decode_parts(forged_header, forged, 2))


def test_an_int8_scale_past_the_cache_dtype_is_refused_not_decoded_to_inf() -> None:
    """127 x a finite forged scale can exceed fp16's range (inf in the cache): int8 scales are bounded by
    what encode can give, the dtype's largest value / 127, and the largest honest one still decodes."""
    values = torch.randn(2, 4, 16, 64).to(torch.float16)
    header, payload = codec.encode(values, Compression.INT8, groups=4)
    largest = float(torch.tensor(torch.finfo(torch.float16).max, dtype=torch.float32) / 127.0)
    for scale, refused in ((1e4, True), (largest * 1.001, True), (largest, False)):
        forged = payload.clone()
        forged[header.data_nbytes :].view(torch.float32)[1] = scale
        forged_header = codec.KVHeader(
            header.codec, header.dtype, header.shape, header.groups, codec.checksum(header, forged)
        )
        if refused:
            with pytest.raises(codec.CodecError, match="within the KV dtype's range"):
                list(codec.decode_parts(forged_header, forged, 2))
        else:
            parts = list(codec.decode_parts(forged_header, forged, 2))
            assert all(bool(torch.isfinite(part).all()) for part in parts)


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
