"""kv_transfer_params come from any HTTP caller: they never raise inside vLLM's scheduler or worker,
they cannot point prefill at a host that is not a decode peer, and they cannot name another TP size
for the other role than the deployment's (security review C1, C1 (c)).

The scheduler state is pure; the worker tests run real ConnectorWorkers (Mooncake on 127.0.0.1)
and a real listening socket as the host a hostile request names.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, consecutive_free_ports, make_caches
from peer_doubles import wait_until

from dllm_connector.peers import MISS_WAIT_S, DecodePeers, PeerNotAllowed
from dllm_connector.scheduler import LoadSpec, SchedulerState, SendSpec, StepPlan
from dllm_connector.worker import ConnectorWorker, WorkerIdentity
from dllm_contract.kvconfig import ConnectorExtraConfig
from dllm_contract.pd_params import DecodeParams, PrefillParams

pytestmark = pytest.mark.timeout(120)

BLOCK = GEOMETRY.block_size
CRASH_BODY = {"dllm": 1, "do_remote_decode": True}  # no transfer_id: killed a prefill engine
LOAD_ON_PREFILL = {"dllm": 1, "do_remote_prefill": True, "transfer_id": "x"}


def extra(**changes: Any) -> ConnectorExtraConfig:
    base: dict[str, Any] = {
        "compression": "none",
        "buffer_size_gb": 0.01,
        "transfer_threshold_tokens": 16,
        "transfer_timeout_ms": 2000,
        "prefill_wait_ms": 5000,
        "hold_seconds": 30,
        "async_transfer": True,
        "protocol": "tcp",
    }
    return ConnectorExtraConfig.model_validate(base | changes)


def state(*, sends: bool = True, receives: bool = True) -> SchedulerState:
    return SchedulerState(extra(), block_size=BLOCK, kv_port=15000, sends=sends, receives=receives)


# ---- the scheduler side --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        CRASH_BODY,
        {"dllm": 1, "do_remote_decode": True, "transfer_id": "t", "decode_kv_port": 0},
        {"dllm": 1, "do_remote_decode": True, "transfer_id": "t" * 300},
        {"dllm": 1, "do_remote_decode": True, "transfer_id": ["t"]},
        {"dllm": 1, "do_remote_prefill": True},
        {"dllm": 1, "do_remote_prefill": True, "transfer_id": "t", "prefill_tp_size": 0},
        {"dllm": 1, "do_remote_prefill": True, "transfer_id": "t", "prefill_tp_size": 8 << 20},
        {"dllm": 1, "do_remote_decode": True, "transfer_id": "t", "decode_tp_size": 8 << 20},
        ["not", "a", "mapping"],
        "a string",
    ],
    ids=[
        "crash-body",
        "port-0",
        "long-id",
        "id-a-list",
        "decode-no-id",
        "tp-0",
        "prefill-tp-huge",
        "decode-tp-huge",
        "a-list",
        "a-string",
    ],
)
def test_invalid_params_mean_no_transfer_and_never_raise(params: Any) -> None:
    engine = state()
    assert engine.matched_tokens(params, 40, 0, "r-1") == (0, False)
    engine.after_alloc("r-1", params, "h", 40, [1, 2, 3], 40)
    assert engine.finished("r-1", params, "h", 40, [1, 2, 3], True) is False
    assert engine.take_plan() == StepPlan()
    assert not engine.has_pending_sends


def test_params_for_the_other_role_are_ignored() -> None:
    prefill_only, decode_only = state(receives=False), state(sends=False)
    decode = DecodeParams(transfer_id="t-1").model_dump()
    prefill = PrefillParams(transfer_id="t-1", decode_host=HOST, decode_kv_port=15000).model_dump()
    assert prefill_only.matched_tokens(LOAD_ON_PREFILL, 40, 0, "p-1") == (0, False)
    assert prefill_only.matched_tokens(decode, 40, 0, "p-1") == (0, False)
    prefill_only.after_alloc("p-1", decode, "h", 40, [1, 2, 3], 40)
    assert prefill_only.take_plan().loads == []
    assert decode_only.finished("d-1", prefill, "h", 40, [1, 2, 3], True) is False
    assert decode_only.take_plan().sends == []
    # each role still does its own part
    assert prefill_only.finished("p-2", prefill, "h", 40, [1, 2, 3], True) is True
    assert decode_only.matched_tokens(decode, 40, 0, "d-2") == (40, True)


def test_ignored_params_are_logged_once_per_request_in_one_short_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = state(receives=False)
    caplog.set_level(logging.WARNING, logger="dllm_connector.scheduler")
    huge = {"dllm": 1, "do_remote_decode": True, "transfer_id": "t" * 1_000_000}
    for _ in range(5):  # vLLM asks again every step a request waits
        engine.matched_tokens(LOAD_ON_PREFILL, 40, 0, "r-1")
    engine.finished("r-2", huge, "h", 40, [1], True)
    engine.finished("r-2", huge, "h", 40, [1], True)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "r-1" in lines[0]
    assert "does not receive KV" in lines[0]
    assert "r-2" in lines[1]
    assert "transfer_id" in lines[1]
    assert all(len(line) < 400 for line in lines)


# ---- the worker side -----------------------------------------------------------------------------


def test_a_load_planned_on_an_engine_that_does_not_receive_fails_through_results() -> None:
    prefill = ConnectorWorker(extra(), GEOMETRY, WorkerIdentity(0, receives=False), "mooncake")
    try:
        prefill.register_kv_caches(make_caches(7), NUM_BLOCKS)
        prefill.start(StepPlan(loads=[LoadSpec("r-1", "t-1", (4, 5), 0, "h")]))
        results = prefill.results()
        assert (results.finished_recving, results.failed_recving) == ({"r-1"}, {"r-1"})
        assert prefill.take_load_errors() == {4, 5}
    finally:
        prefill.close()


def test_a_send_planned_on_an_engine_that_does_not_send_ends_through_results() -> None:
    decode = ConnectorWorker(
        extra(), GEOMETRY, WorkerIdentity(consecutive_free_ports(1), sends=False), "mooncake"
    )
    try:
        decode.register_kv_caches(make_caches(None), NUM_BLOCKS)
        decode.start(StepPlan(sends=[SendSpec("r-1", "t-1", (4, 5), HOST, 15000, "h")]))
        assert decode.results().finished_sending == {"r-1"}  # vLLM frees the blocks
        assert "does not send" in decode.failures["t-1"]
    finally:
        decode.close()


@pytest.fixture
def stranger() -> Iterator[socket.socket]:
    """A real listener on 127.0.0.2, the host a hostile request names instead of a decode pod, on a port
    the system had free on 127.0.0.1 too (the test's decode listens there on the same number)."""
    with socket.socket() as on_loopback:
        on_loopback.bind(("127.0.0.1", 0))
        listener = socket.socket()
        listener.bind(("127.0.0.2", on_loopback.getsockname()[1]))
    listener.listen(4)
    listener.setblocking(False)
    yield listener
    listener.close()


def connections(listener: socket.socket) -> int:
    count = 0
    while True:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return count
        sock.close()
        count += 1


def test_prefill_sends_only_to_its_decode_peers(stranger: socket.socket) -> None:
    decode_port = int(stranger.getsockname()[1])
    decode = ConnectorWorker(extra(), GEOMETRY, WorkerIdentity(decode_port, sends=False), "mooncake")
    decode.register_kv_caches(make_caches(None), NUM_BLOCKS)
    # the operator names the decode Service; here "localhost" plays it (it resolves to 127.0.0.1)
    config = extra(decode_host="localhost", decode_port=decode_port)
    prefill = ConnectorWorker(config, GEOMETRY, WorkerIdentity(0, receives=False), "mooncake")
    try:
        prefill.register_kv_caches(make_caches(7), NUM_BLOCKS)
        sends = [
            SendSpec("r-1", "t-stranger", (1, 2), "127.0.0.2", decode_port, "h"),
            SendSpec("r-2", "t-port", (1, 2), HOST, decode_port + 1, "h"),
            SendSpec("r-3", "t-name", (1, 2), "no-such-host.invalid", decode_port, "h"),
            SendSpec("r-4", "t-ok", (1, 2), HOST, decode_port, "h"),
        ]
        decode.start(StepPlan(loads=[LoadSpec("d-4", "t-ok", (7, 8), 0, "h")]))
        prefill.start(StepPlan(sends=sends))
        ended: set[str] = set()

        def all_ended() -> bool:
            ended.update(prefill.results().finished_sending)
            return len(ended) == 4

        assert wait_until(all_ended, 30)
        assert "not one of the decode peers" in prefill.failures["t-stranger"]
        assert "not this deployment's" in prefill.failures["t-port"]
        assert "does not resolve" in prefill.failures["t-name"]
        assert "t-ok" not in prefill.failures
        assert connections(stranger) == 0  # prefill never connected to the named stranger
        assert decode.receiver is not None
        assert decode.receiver.wait_settled("t-ok", 10)
        assert decode.results().failed_recving == set()
    finally:
        prefill.close()
        decode.close()


@dataclass
class FakeClock:
    """A clock double for DecodePeers: `sleep` moves it on at once and records how long was asked."""

    now: float = 1000.0
    slept: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_decode_peers_follow_the_service_and_refuse_the_rest() -> None:
    table = {"decode-svc": {"10.0.0.5", "10.0.0.6"}, "10.0.0.5": {"10.0.0.5"}, "10.0.0.9": {"10.0.0.9"}}
    clock = FakeClock()

    def lookup(host: str) -> set[str]:
        return set(table.get(host, set()))

    peers = DecodePeers("decode-svc", 50051, "10.0.0.1", lookup=lookup, clock=clock, sleep=clock.sleep)
    assert peers.address("10.0.0.5", 50051) == "10.0.0.5"
    with pytest.raises(PeerNotAllowed, match="not one of the decode peers"):
        peers.address("10.0.0.9", 50051)
    assert sum(clock.slept) <= MISS_WAIT_S  # a stranger is refused within the bounded wait
    table["decode-svc"] = {"10.0.0.9"}  # a new decode pod became ready, .5 is terminating
    assert peers.address("10.0.0.9", 50051) == "10.0.0.9"
    assert peers.address("10.0.0.5", 50051) == "10.0.0.5"  # requests routed to it still get their KV
    forgetful = DecodePeers(
        "decode-svc", 50051, "10.0.0.1", lookup=lookup, remember_s=0.0, clock=clock, sleep=clock.sleep
    )
    assert forgetful.address("10.0.0.9", 50051) == "10.0.0.9"
    with pytest.raises(PeerNotAllowed):
        forgetful.address("10.0.0.5", 50051)  # no longer listed, and not remembered
    with pytest.raises(PeerNotAllowed, match="port"):
        peers.address("10.0.0.5", 8000)
    own = DecodePeers(None, None, "10.0.0.1", lookup=lambda host: {host}, clock=clock, sleep=clock.sleep)
    assert own.address("10.0.0.1", 1234) == "10.0.0.1"
    with pytest.raises(PeerNotAllowed):
        own.address("10.0.0.2", 1234)


def test_a_decode_pod_the_service_lists_just_after_a_lookup_is_allowed_on_its_first_send() -> None:
    """Issue 31: the router saw a new decode pod ready a moment after this engine's lookup; its
    first send waited for the next lookup instead of failing (decode then waited a minute and 500ed)."""
    clock = FakeClock()
    listed = {"decode-svc": {"10.0.0.5"}}
    lookups: list[float] = []

    def lookup(host: str) -> set[str]:
        if host == "decode-svc":
            lookups.append(clock.now)
            if clock.now >= 1003.5:  # the Service's answer names the new pod from here on
                listed["decode-svc"] = {"10.0.0.5", "10.0.0.7"}
            return set(listed["decode-svc"])
        return {host}

    peers = DecodePeers("decode-svc", 50051, "10.0.0.1", lookup=lookup, clock=clock, sleep=clock.sleep)
    assert peers.address("10.0.0.5", 50051) == "10.0.0.5"  # a lookup at 1000.0
    clock.now += 0.3
    assert peers.address("10.0.0.7", 50051) == "10.0.0.7"
    assert clock.now == pytest.approx(1004.0)  # lookups once a second until the Service named it
    assert lookups == pytest.approx([1000.0, 1001.0, 1002.0, 1003.0, 1004.0])


# ---- C1 (c): the other role's TP size is the deployment's -------------------------------------------


@pytest.fixture
def decode_ranks() -> Iterator[list[socket.socket]]:
    """Real listeners where a decode of TP 2 would listen (ports from the OS: port, port + 1)."""
    port = consecutive_free_ports(2)
    listeners = [socket.create_server((HOST, port + rank)) for rank in range(2)]
    for listener in listeners:
        listener.setblocking(False)
    yield listeners
    for listener in listeners:
        listener.close()


@pytest.mark.parametrize("forged", [256, 3, 1], ids=["fan-out-256", "three", "one"])
def test_a_decode_tp_size_other_than_the_deployments_is_refused_and_opens_no_connection(
    decode_ranks: list[socket.socket], forged: int
) -> None:
    port = int(decode_ranks[0].getsockname()[1])
    config = extra(decode_host="localhost", decode_port=port, peer_tp_size=2)  # decode runs TP 2
    engine = SchedulerState(config, block_size=BLOCK, kv_port=0, receives=False, tp_size=1)
    asked = PrefillParams(transfer_id="t-fan", decode_host=HOST, decode_kv_port=port, decode_tp_size=forged)
    assert engine.finished("r-1", asked.model_dump(), "h", 40, [1, 2, 3], True) is False  # blocks freed
    plan = engine.take_plan()
    assert plan == StepPlan()
    prefill = ConnectorWorker(config, GEOMETRY, WorkerIdentity(0, receives=False), "mooncake")
    try:
        prefill.register_kv_caches(make_caches(7), NUM_BLOCKS)
        prefill.start(plan)
        assert prefill.sender is not None
        assert prefill.sender.wait_idle(10)
        assert prefill.results().finished_sending == set()
    finally:
        prefill.close()
    assert [connections(listener) for listener in decode_ranks] == [0, 0]
    honest = asked.model_copy(update={"decode_tp_size": 2}).model_dump()
    assert engine.finished("r-2", honest, "h", 40, [1, 2, 3], True) is True  # the deployment's passes
    assert engine.take_plan().sends[0].decode_tp_size == 2
