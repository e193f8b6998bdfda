"""The two worker halves of our vLLM connector moving real KV through Mooncake on 127.0.0.1: each
receive reported once, loads that fail name their blocks, the handshake refusing mismatched peers, and
the side channel's token."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, consecutive_free_ports, make_caches
from vllm_plugin_cases import extra

from dllm_connector.layout import PagedKV
from dllm_connector.scheduler import SchedulerState, StepPlan
from dllm_connector.worker import ConnectorWorker, WorkerIdentity
from dllm_contract.pd_params import DecodeParams, PrefillParams

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


@pytest.fixture
def workers() -> Iterator[tuple[ConnectorWorker, ConnectorWorker, int]]:
    decode_kv_port = consecutive_free_ports(1)  # not a fixed one: Mooncake draws RPC ports near 15000
    prefill = ConnectorWorker(
        extra(compression="fp8"), GEOMETRY, WorkerIdentity(0, receives=False), "mooncake"
    )
    decode = ConnectorWorker(
        extra(compression="fp8", prefill_wait_ms=400),
        GEOMETRY,
        WorkerIdentity(decode_kv_port, sends=False),
        "mooncake",
    )
    prefill.register_kv_caches(make_caches(7), NUM_BLOCKS)
    decode.register_kv_caches(make_caches(None), NUM_BLOCKS)
    yield prefill, decode, decode_kv_port
    prefill.close()
    decode.close()


def plans(
    prompt_len: int, prefill_blocks: list[int], decode_blocks: list[int], port: int
) -> tuple[StepPlan, StepPlan]:
    config = extra()
    decode_state = SchedulerState(config, block_size=GEOMETRY.block_size, kv_port=port)
    prefill_state = SchedulerState(config, block_size=GEOMETRY.block_size, kv_port=0)
    decode_params = DecodeParams(transfer_id="tx-w").model_dump()
    prefill_params = PrefillParams(transfer_id="tx-w", decode_host=HOST, decode_kv_port=port).model_dump()
    count, is_async = decode_state.matched_tokens(decode_params, prompt_len, 0)
    assert is_async
    decode_state.after_alloc("d-1", decode_params, "h", prompt_len, decode_blocks, count)
    assert prefill_state.finished("p-1", prefill_params, "h", prompt_len, prefill_blocks, True)
    return prefill_state.take_plan(), decode_state.take_plan()


def test_workers_move_kv_and_report_each_receive_once(
    workers: tuple[ConnectorWorker, ConnectorWorker, int],
) -> None:
    prefill, decode, port = workers
    prefill_blocks, decode_blocks = [40, 3, 77, 12, 5], [200, 100, 9, 401, 64, 1]
    prefill_plan, decode_plan = plans(70, prefill_blocks, decode_blocks, port)
    decode.start(decode_plan)
    prefill.start(prefill_plan)
    assert decode.receiver is not None
    assert prefill.sender is not None
    assert decode.receiver.wait_settled("tx-w", timeout=30)
    assert prefill.sender.wait_idle(timeout=30)
    received = decode.results()
    assert (received.finished_recving, received.failed_recving) == ({"d-1"}, set())
    assert prefill.results().finished_sending == {"p-1"}
    assert decode.results().finished_recving == set()  # exactly once
    assert decode.take_load_errors() == set()
    want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(prefill_blocks)
    assert decode.kv is not None
    got = decode.kv.gather(decode_blocks[:5])
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.04
    assert decode.stats()["received"] == 1
    assert decode.stats()["raw_bytes"] > decode.stats()["bytes_on_wire"]  # fp8 on the wire


def test_a_prefill_that_never_sends_fails_the_load_with_its_blocks(
    workers: tuple[ConnectorWorker, ConnectorWorker, int],
) -> None:
    _, decode, port = workers
    _, decode_plan = plans(70, [1, 2, 3, 4, 5], [10, 11, 12, 13, 14], port)
    decode.start(decode_plan)
    assert decode.receiver is not None
    assert decode.receiver.wait_settled("tx-w", timeout=10)
    results = decode.results()
    assert results.finished_recving == {"d-1"}
    assert results.failed_recving == {"d-1"}
    assert decode.take_load_errors() == {10, 11, 12, 13, 14}
    assert decode.take_load_errors() == set()
    assert decode.stats()["timeouts"] == 1
    assert not decode.receiver.pending
    assert decode.receiver.staging.in_use == 0
    assert decode.kv is not None
    assert int(torch.count_nonzero(decode.kv.gather([10, 11]))) == 0


@pytest.mark.parametrize(
    ("prefill_identity", "decode_identity", "named_engine", "message"),
    [
        ({"tp_size": 2}, {}, None, "prefill TP size 2 offered, decode (TP 1) expects prefill TP 1"),
        (
            {},
            {"engine_id": "decode-b"},
            "decode-a",
            "prefill was sent to decode engine 'decode-a', this is 'decode-b'",
        ),
    ],
)
def test_handshake_refuses_mismatched_parallelism_and_engines(
    prefill_identity: dict[str, Any], decode_identity: dict[str, Any], named_engine: str | None, message: str
) -> None:
    config = extra(prefill_wait_ms=5000)
    prefill = ConnectorWorker(
        config, GEOMETRY, WorkerIdentity(0, receives=False, **prefill_identity), "mooncake"
    )
    decode = ConnectorWorker(config, GEOMETRY, WorkerIdentity(0, sends=False, **decode_identity), "mooncake")
    try:
        prefill.register_kv_caches(make_caches(7), NUM_BLOCKS)
        decode.register_kv_caches(make_caches(None), NUM_BLOCKS)
        assert decode.receiver is not None
        assert prefill.sender is not None
        prefill_plan, decode_plan = plans(40, [1, 2, 3], [4, 5, 6], decode.receiver.port)
        prefill_plan.sends[0] = replace(prefill_plan.sends[0], engine_id=named_engine)
        decode.start(decode_plan)
        prefill.start(prefill_plan)
        assert decode.receiver.wait_settled("tx-w", timeout=30)
        assert prefill.sender.wait_idle(timeout=30)
        results = decode.results()
        assert results.failed_recving == {"d-1"}
        assert decode.take_load_errors() == {4, 5, 6}
        assert prefill.results().finished_sending == {"p-1"}  # the send ended (failed): blocks freed
        assert message in prefill.failures["tx-w"]
        assert message in decode.failures["tx-w"]
    finally:
        prefill.close()
        decode.close()


def test_a_reused_transfer_id_fails_only_the_second_request(
    workers: tuple[ConnectorWorker, ConnectorWorker, int],
) -> None:
    _, decode, port = workers
    _, first = plans(70, [1, 2, 3, 4, 5], [10, 11, 12, 13, 14], port)
    _, second = plans(40, [1, 2, 3], [20, 21, 22], port)
    second.loads[0] = replace(second.loads[0], request_id="d-2")
    decode.start(first)
    decode.start(second)  # same transfer id "tx-w": refused, the engine step goes on
    results = decode.results()
    assert (results.finished_recving, results.failed_recving) == ({"d-2"}, {"d-2"})
    assert decode.take_load_errors() == {20, 21, 22}
    assert decode.receiver is not None
    assert decode.receiver.pending == {"tx-w"}  # the first request still waits for its KV


def test_out_of_range_blocks_fail_the_load_not_the_engine(
    workers: tuple[ConnectorWorker, ConnectorWorker, int],
) -> None:
    _, decode, port = workers
    _, plan = plans(40, [1, 2, 3], [20, 21, NUM_BLOCKS + 5], port)
    decode.start(plan)
    results = decode.results()
    assert results.failed_recving == {"d-1"}
    assert decode.take_load_errors() == {20, 21, NUM_BLOCKS + 5}


def token_workers(
    monkeypatch: pytest.MonkeyPatch, prefill_token: str, decode_token: str
) -> tuple[ConnectorWorker, ConnectorWorker, int]:
    """Workers that read DLLM_KV_AUTH_TOKEN from their environment, as in an engine pod (C2, H4)."""
    decode_kv_port = consecutive_free_ports(1)
    prefill = ConnectorWorker(extra(), GEOMETRY, WorkerIdentity(0, receives=False), "mooncake")
    decode = ConnectorWorker(
        extra(prefill_wait_ms=3000), GEOMETRY, WorkerIdentity(decode_kv_port, sends=False), "mooncake"
    )
    monkeypatch.setenv("DLLM_KV_AUTH_TOKEN", prefill_token)
    prefill.register_kv_caches(make_caches(7), NUM_BLOCKS)
    monkeypatch.setenv("DLLM_KV_AUTH_TOKEN", decode_token)
    decode.register_kv_caches(make_caches(None), NUM_BLOCKS)
    return prefill, decode, decode_kv_port


def test_workers_sharing_the_token_move_kv_and_a_stranger_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    token = "k" * 40
    prefill, decode, port = token_workers(monkeypatch, token, token)
    try:
        prefill_plan, decode_plan = plans(70, [1, 2, 3, 4, 5], [10, 11, 12, 13, 14], port)
        decode.start(decode_plan)
        prefill.start(prefill_plan)
        assert decode.receiver is not None
        assert decode.receiver.wait_settled("tx-w", timeout=30)
        assert decode.results().failed_recving == set()
    finally:
        prefill.close()
        decode.close()

    prefill, decode, port = token_workers(monkeypatch, "s" * 40, token)
    try:
        prefill_plan, decode_plan = plans(70, [1, 2, 3, 4, 5], [10, 11, 12, 13, 14], port)
        decode.start(decode_plan)
        prefill.start(prefill_plan)
        assert prefill.sender is not None
        assert prefill.sender.wait_idle(timeout=30)
        assert prefill.results().finished_sending == {"p-1"}
        assert any("authentic" in reason.lower() for reason in prefill.failures.values())
        assert decode.receiver is not None
        assert "tx-w" in decode.receiver.pending, "nothing reached the expectation"
    finally:
        prefill.close()
        decode.close()
