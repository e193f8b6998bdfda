"""A cancelled load, a hung write and a closing sender never free memory that is still written
(security review H5, M4).

Real KVSender and KVReceiver over real Mooncake transports on 127.0.0.1. The fault, a write that
does not go through until the test lets it, comes from GatedTransportDouble (peer_doubles.py),
which wraps prefill's real transport.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, pipe_config
from peer_doubles import FakeDecode, GatedTransportDouble, read_until_closed, wait_until

from dllm_connector import codec
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import SchedulerState, prompt_hash
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.worker import ConnectorWorker, WorkerIdentity
from dllm_contract.kvconfig import Compression, ConnectorExtraConfig
from dllm_contract.pd_params import DecodeParams

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

TIMEOUT_MS = 1000
TIMEOUT = TIMEOUT_MS / 1000
HOLD_SECONDS = 60
HOLD = float(HOLD_SECONDS)
HASH = prompt_hash([4, 5, 6])
SRC = tuple(range(10, 18))
DST = (100, 3, 250, 41, 7, 300, 12, 99)


def config(**changes: Any) -> PipeConfig:
    base = {
        "buffer_size_gb": gb(16 << 20),
        "transfer_timeout_ms": TIMEOUT_MS,
        "prefill_wait_ms": HOLD_SECONDS * 1000,
        "hold_seconds": HOLD_SECONDS,
        "transfer_threshold_tokens": GEOMETRY.block_size,  # one block per chunk: many chunks
    }
    return pipe_config(**(base | changes))


@pytest.fixture
def receiver(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVReceiver]:
    receiver = KVReceiver(transports[0], PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config(), HOST, 0)
    yield receiver
    receiver.close()
    assert receiver.staging.in_use == 0


@pytest.fixture
def gated(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[GatedTransportDouble]:
    double = GatedTransportDouble(transports[1])
    yield double
    double.open()


def gated_sender(gated: GatedTransportDouble, **changes: Any) -> KVSender:
    kv, settings = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config(**changes)
    # As the worker does at engine start: a first build of the codec's kernels (a cold cache) would
    # otherwise delay the first send past decode's one-second wait, which is not the fault under test.
    codec.warm_up(kv.gather([0]), settings.compression, kv.layout.groups)
    sender = KVSender(gated, kv, settings)
    sender.zero_copy_piece_bytes = 1  # one write per layer
    return sender


def outcome_of(sender: KVSender, transfer_id: str, timeout: float) -> str | None:
    seen: dict[str, str | None] = {}
    assert wait_until(lambda: seen.update(sender.finished()) or transfer_id in seen, timeout)
    return seen[transfer_id]


def test_a_cancelled_zero_copy_load_is_reported_only_after_its_last_write(
    receiver: KVReceiver, gated: GatedTransportDouble
) -> None:
    sender = gated_sender(gated)
    assert sender.zero_copy
    try:
        receiver.expect("h5-a", DST, prompt_hash=HASH)
        sender.submit(SendJob("h5-a", SRC, HOST, receiver.port, HASH))
        gated.release(3)  # three layers land in decode's blocks, the fourth waits at the gate
        assert wait_until(lambda: len(gated.writes) == 3 and gated.waiting == 1, 10)
        receiver.cancel("h5-a")  # vLLM aborted the request mid-transfer
        assert receiver.results() == {}  # a write into its blocks may still happen: not ended
        assert receiver.pending == {"h5-a"}
        assert wait_until(lambda: receiver.stats.stops_requested == 1, 10)  # prefill was told
        gated.open()
        outcome = receiver.wait_for("h5-a", 10)
        reported = time.monotonic()
        assert outcome == "cancelled by decode"
        assert max(write.ended for write in gated.writes) < reported
        assert len(gated.writes) < len(SRC) * 4  # prefill was told to stop and did
        sent = outcome_of(sender, "h5-a", 10)
        assert sent is not None
        assert "cancelled by decode" in sent
        assert sender.in_flight == set()
    finally:
        assert sender.close(timeout=30)
    assert sender.staging.in_use == 0
    assert not receiver.pending


def test_a_write_hung_past_the_timeout_keeps_both_sides_memory_until_it_returns(
    receiver: KVReceiver, gated: GatedTransportDouble
) -> None:
    """fp8 goes through both sides' staging: neither side frees or reports while the write hangs."""
    sender = gated_sender(gated, compression=Compression.FP8)
    try:
        receiver.expect("h5-b", DST, prompt_hash=HASH)
        sender.submit(SendJob("h5-b", SRC, HOST, receiver.port, HASH))
        assert wait_until(lambda: gated.waiting == 1, 10)
        seen: dict[str, str | None] = {}
        assert not wait_until(lambda: seen.update(sender.finished()) or seen, 3 * TIMEOUT)
        assert sender.staging.in_use > 0
        assert receiver.results() == {}  # decode timed out waiting, and still waits for the sender
        assert receiver.staging.in_use > 0
        gated.open()
        outcome = receiver.wait_for("h5-b", 10)
        assert outcome is not None
        assert "no side-channel message" in outcome
        assert max(write.ended for write in gated.writes) < time.monotonic()
        sent = outcome_of(sender, "h5-b", 10)
        assert sent is not None
        assert sender.staging.in_use == 0
    finally:
        assert sender.close(timeout=30)


def extra(**changes: Any) -> ConnectorExtraConfig:
    base: dict[str, Any] = {
        "compression": "none",
        "buffer_size_gb": 0.01,
        "transfer_threshold_tokens": 16,
        "transfer_timeout_ms": 2000,
        "prefill_wait_ms": 30000,
        "hold_seconds": 30,
        "async_transfer": True,
        "protocol": "tcp",
    }
    return ConnectorExtraConfig.model_validate(base | changes)


def test_a_cancelled_load_reports_no_load_error_blocks() -> None:
    decode = ConnectorWorker(extra(), GEOMETRY, WorkerIdentity(0, sends=False), "mooncake")
    state = SchedulerState(extra(), block_size=GEOMETRY.block_size, kv_port=0, sends=False)
    params = DecodeParams(transfer_id="h5-c").model_dump()
    try:
        decode.register_kv_caches(make_caches(None), NUM_BLOCKS)
        count, _ = state.matched_tokens(params, 40, 0, "d-1")
        state.after_alloc("d-1", params, "h", 40, [20, 21, 22], count)
        decode.start(state.take_plan())
        assert not state.finished("d-1", params, "h", 40, [20, 21, 22], False)  # vLLM aborted it
        decode.start(state.take_plan())
        results = decode.results()
        assert results.finished_recving == {"d-1"}  # vLLM may now free its blocks ...
        assert results.failed_recving == set()
        assert decode.take_load_errors() == set()  # ... and no other request is failed for them
    finally:
        decode.close()


# ---- M4: closing the sender ------------------------------------------------------------------------


def test_close_waits_for_a_running_send_before_unregistering(
    transports: tuple[MooncakeTransport, MooncakeTransport], gated: GatedTransportDouble
) -> None:
    patient = config(transfer_timeout_ms=30_000)  # the write is held longer than TIMEOUT here
    receiver = KVReceiver(transports[0], PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), patient, HOST, 0)
    sender = gated_sender(gated, transfer_timeout_ms=30_000)
    try:
        receiver.expect("m4-run", DST, prompt_hash=HASH)
        sender.submit(SendJob("m4-run", SRC, HOST, receiver.port, HASH))
        assert wait_until(lambda: gated.waiting == 1, 10)
        closed: list[bool] = []
        closer = threading.Thread(target=lambda: closed.append(sender.close(timeout=60)))
        closer.start()
        assert not wait_until(lambda: closed, 2.0)  # the write under way holds close
        assert gated.unregistered == []
        gated.open()
        closer.join(timeout=60)
        assert closed == [True]
        assert gated.unregistered
        assert min(gated.unregistered) > max(write.ended for write in gated.writes)
        assert receiver.wait_for("m4-run", 10) == ""  # it ran to its end
        assert outcome_of(sender, "m4-run", 1) is None
    finally:
        receiver.close()


def test_close_ends_a_send_still_waiting_for_decode_at_once(
    transports: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    def never_answers(sock: socket.socket) -> None:
        read_until_closed(sock, 60)

    decode = FakeDecode(never_answers)
    sender = KVSender(transports[1], PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config())
    try:
        sender.submit(SendJob("m4-wait", SRC, HOST, decode.port, HASH))
        assert wait_until(lambda: decode.connections == 1, 10)
        started = time.monotonic()
        assert sender.close(timeout=30)
        assert time.monotonic() - started < 5  # not the 60 s hold
        outcome = outcome_of(sender, "m4-wait", 1)
        assert outcome is not None
        assert "closing" in outcome
        sender.submit(SendJob("m4-late", SRC, HOST, decode.port, HASH))
        assert outcome_of(sender, "m4-late", 1) == "the KV sender is closing"
    finally:
        decode.close()


def test_closing_the_receiver_waits_for_the_parts_under_way(
    transports: tuple[MooncakeTransport, MooncakeTransport], gated: GatedTransportDouble
) -> None:
    """vLLM shuts decode down mid-load: its blocks stay registered until prefill stopped writing."""
    recording = GatedTransportDouble(transports[0])  # decode's side: only its unregistrations count
    recording.open()
    receiver = KVReceiver(recording, PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY), config(), HOST, 0)
    sender = gated_sender(gated)
    try:
        receiver.expect("m4-recv", DST, prompt_hash=HASH)
        sender.submit(SendJob("m4-recv", SRC, HOST, receiver.port, HASH))
        assert wait_until(lambda: gated.waiting == 1, 10)
        closed: list[bool] = []
        closer = threading.Thread(target=lambda: closed.append(receiver.close(timeout=30)))
        closer.start()
        assert not wait_until(lambda: closed, 0.5)  # prefill's write under way holds it
        assert recording.unregistered == []
        gated.open()
        closer.join(timeout=30)
        assert closed == [True]
        assert min(recording.unregistered) > max(write.ended for write in gated.writes)
        assert receiver.results() == {"m4-recv": "receiver closed"}
        outcome = outcome_of(sender, "m4-recv", 10)
        assert outcome is not None
    finally:
        assert sender.close(timeout=30)
    assert receiver.staging.in_use == 0
