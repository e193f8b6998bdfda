"""The two worker halves of our vLLM connector moving real KV through Mooncake on 127.0.0.1: each
receive reported once, loads that fail name their blocks, the handshake refusing mismatched peers, and
the side channel's token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kv_peer import GEOMETRY, HOST, LAYERS, NUM_BLOCKS, consecutive_free_ports, make_caches
from private_prom import metric_types
from vllm_plugin_cases import extra, settings, vllm_config

from dllm_connector.connector import DllmConnectorStats, DllmMooncakeConnector
from dllm_connector.layout import PagedKV
from dllm_connector.scheduler import SchedulerState, StepPlan
from dllm_connector.worker import ConnectorWorker, WorkerIdentity
from dllm_contract.kvconfig import Connector, Role, kv_transfer_config
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


def prom_text(role: Role, reports: list[dict[str, Any]]) -> str:
    """The connector's metrics after these stats reports, as vLLM's /metrics prints them (on a
    registry of this test's own: vLLM's is process-wide)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    config = vllm_config(kv_transfer_config(settings(Connector.MOONCAKE, role), "engine-a"))
    metrics = DllmMooncakeConnector.build_prom_metrics(
        config, metric_types(registry), ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    for report in reports:
        metrics.observe(report, 0)
    return str(generate_latest(registry).decode())


def report(worker: ConnectorWorker) -> dict[str, Any]:
    """What the worker side of the connector reports to vLLM (its stats since the last report)."""
    data: dict[str, Any] = {key: value for key, value in worker.stats().items() if value}
    if seconds := worker.take_durations():
        data["transfer_seconds"] = seconds
    if waits := worker.take_queued():
        data["queue_seconds"] = waits
    return DllmConnectorStats(data=data).aggregate(DllmConnectorStats(data={})).data


def test_each_side_counts_the_transfer_its_kv_bytes_wire_bytes_and_seconds_on_metrics(
    workers: tuple[ConnectorWorker, ConnectorWorker, int],
) -> None:
    prefill, decode, port = workers
    prefill_plan, decode_plan = plans(70, [40, 3, 77, 12, 5], [200, 100, 9, 401, 64, 1], port)
    decode.start(decode_plan)
    prefill.start(prefill_plan)
    assert decode.receiver is not None
    assert prefill.sender is not None
    assert decode.receiver.wait_settled("tx-w", timeout=30)
    assert prefill.sender.wait_idle(timeout=30)
    # 5 blocks x 16 tokens x 2 heads x (K and V of 64) x bf16 x LAYERS layers: the cache's bytes
    kv_bytes = 5 * GEOMETRY.block_size * 2 * 2 * 64 * 2 * LAYERS
    for worker, role, way in ((prefill, Role.PREFILL, "send"), (decode, Role.DECODE, "receive")):
        text = prom_text(role, [report(worker)])
        wire = worker.stats()["bytes_on_wire"]
        assert 0 < wire < kv_bytes  # fp8: one byte a value, plus each block's scales
        assert sample(text, "vllm:dllm_kv_transfers_total", direction=way) == 1
        assert sample(text, "vllm:dllm_kv_bytes_total", direction=way, kind="kv") == kv_bytes
        assert sample(text, "vllm:dllm_kv_bytes_total", direction=way, kind="wire") == wire
        assert sample(text, "vllm:dllm_kv_transfer_seconds_count", direction=way) == 1
        assert sample(text, "vllm:dllm_kv_transfer_failures_total", direction=way, reason="timeout") == 0
        # the codec's share of the transfer: fp8 both ways, within the transfer's own time
        codec_seconds = sample(text, "vllm:dllm_kv_codec_seconds_total", direction=way)
        assert 0 < codec_seconds <= sample(text, "vllm:dllm_kv_transfer_seconds_sum", direction=way)
        # prefill's one send waited for its connection once; decode sends nothing
        queued = sample(text, "vllm:dllm_kv_queue_seconds_count", direction=way)
        assert queued == (1 if way == "send" else 0)
        assert worker.take_durations() == []  # taken once


def test_a_load_that_times_out_is_a_timeout_failure_on_metrics(
    workers: tuple[ConnectorWorker, ConnectorWorker, int],
) -> None:
    _, decode, port = workers
    _, decode_plan = plans(70, [1, 2, 3, 4, 5], [10, 11, 12, 13, 14], port)
    decode.start(decode_plan)
    assert decode.receiver is not None
    assert decode.receiver.wait_settled("tx-w", timeout=10)
    text = prom_text(Role.DECODE, [report(decode)])
    way = "receive"
    assert sample(text, "vllm:dllm_kv_transfer_failures_total", direction=way, reason="timeout") == 1
    assert sample(text, "vllm:dllm_kv_transfer_failures_total", direction=way, reason="other") == 0
    assert sample(text, "vllm:dllm_kv_transfers_total", direction=way) == 0
    assert sample(text, "vllm:dllm_kv_transfer_seconds_count", direction=way) == 0


def sample(text: str, name: str, **labels: str) -> float:
    """The one sample of `name` with these labels (and the engine's); absent is an error, not 0."""
    from prometheus_client.parser import text_string_to_metric_families

    want = labels | {"model_name": "tiny", "engine": "0"}
    found = [
        point.value
        for family in text_string_to_metric_families(text)
        for point in family.samples
        if point.name == name and point.labels == want
    ]
    assert len(found) == 1, f"{name}{want}: {len(found)} samples in\n{text}"
    return float(found[0])
