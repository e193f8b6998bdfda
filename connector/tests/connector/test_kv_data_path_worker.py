"""The worker's data path: chosen once its caches are registered, logged once and reported in its
stats and an info gauge; a bad setting stops it by name before anything starts; the NCCL
connector's backend follows where the staging is; the connector reports the path in its first
stats only.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from kv_peer import GEOMETRY, NUM_BLOCKS, consecutive_free_ports, make_caches
from private_prom import metric_types
from vllm_plugin_cases import settings, vllm_config

from dllm_connector.connector import DllmConnectorStats, DllmMooncakeConnector
from dllm_connector.prom_metrics import DATA_PATH_METRIC
from dllm_connector.transport.placement import PathSetting
from dllm_connector.transport.sidechannel import connections_for
from dllm_connector.transport.torchdist import TorchDistTransport
from dllm_connector.tuning import ENV_NAMES, TuningInvalid
from dllm_connector.worker import ConnectorWorker, WorkerIdentity, make_transport
from dllm_contract.kvconfig import Connector, ConnectorExtraConfig, Role, kv_transfer_config

DATA_PATH_ENV = ENV_NAMES["data_path"]


def worker_extra() -> ConnectorExtraConfig:
    settings_ = settings(Connector.PYNCCL, Role.PREFILL)
    return ConnectorExtraConfig.model_validate(
        kv_transfer_config(settings_, "e")["kv_connector_extra_config"]
    )


@pytest.mark.parametrize("setting", ["device", "pinned-host"])
def test_the_worker_logs_its_data_path_once_and_reports_it(
    setting: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(DATA_PATH_ENV, setting)
    worker = ConnectorWorker(worker_extra(), GEOMETRY, WorkerIdentity(0, receives=False), "nccl")
    with caplog.at_level(logging.INFO, logger="dllm_connector.worker"):
        worker.register_kv_caches(make_caches(None), NUM_BLOCKS)
    try:
        lines = [record.getMessage() for record in caplog.records if "KV data path" in record.getMessage()]
        assert len(lines) == 1
        assert f"torch.distributed (gloo)): {setting}" in lines[0]  # a CPU cache: gloo, not NCCL
        levels = worker.data_path_levels()
        assert levels["data_path"] == setting
        assert levels["data_path_transport"] == "torch.distributed (gloo)"
        assert levels["data_path_reason"] in lines[0]
    finally:
        worker.close()


def test_a_bad_data_path_setting_stops_the_worker_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_PATH_ENV, "gpu")
    worker = ConnectorWorker(worker_extra(), GEOMETRY, WorkerIdentity(0, receives=False), "mooncake")
    with pytest.raises(TuningInvalid, match=f"{DATA_PATH_ENV}: KV data path 'gpu': expected one of"):
        worker.register_kv_caches(make_caches(None), NUM_BLOCKS)
    assert worker.transport is None  # nothing was started, so nothing is left running
    assert worker.sender is None


def test_an_unknown_codec_kernel_set_stops_the_worker_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, an unknown name warned and native served; a typo now stops the engine as other
    settings do."""
    monkeypatch.setenv(ENV_NAMES["codec_kernels"], "fast")
    worker = ConnectorWorker(worker_extra(), GEOMETRY, WorkerIdentity(0, receives=False), "mooncake")
    with pytest.raises(
        TuningInvalid, match="DLLM_KV_CODEC_KERNELS: 'fast' is none of native, compiled, plain"
    ):
        worker.register_kv_caches(make_caches(None), NUM_BLOCKS)
    assert worker.transport is None
    assert worker.sender is None


def test_the_data_path_is_a_level_in_the_stats_and_an_info_gauge() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()

    levels = {"data_path": "pinned-host", "data_path_transport": "mooncake (tcp)", "data_path_reason": "why"}
    workers = DllmConnectorStats(data={"sent": 2}).aggregate(DllmConnectorStats(data={"sent": 1} | levels))
    assert workers.reduce() == {"sent": 3} | levels  # the levels are kept, not summed
    metrics = DllmMooncakeConnector.build_prom_metrics(
        vllm_config(kv_transfer_config(settings(Connector.MOONCAKE, Role.PREFILL), "engine-a")),
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    metrics.observe(workers.reduce(), 0)
    text = generate_latest(registry).decode()
    assert (
        f'{DATA_PATH_METRIC}{{engine="0",model_name="tiny",path="pinned-host",reason="why",'
        'transport="mooncake (tcp)"} 1.0'
    ) in text


@pytest.mark.parametrize(
    ("device", "setting", "backend"),
    [
        ("cuda", PathSetting.AUTO, "nccl"),  # device staging: NCCL moves the device tensors
        ("cuda", PathSetting.DEVICE, "nccl"),
        ("cuda", PathSetting.PINNED_HOST, "gloo"),  # host staging: NCCL cannot move it
        ("cuda", PathSetting.HOST, "gloo"),
        ("cpu", PathSetting.AUTO, "gloo"),
        ("cpu", PathSetting.DEVICE, "gloo"),
    ],
)
def test_the_nccl_connector_picks_its_backend_by_where_the_staging_is(
    device: str, setting: PathSetting, backend: str
) -> None:
    """No group is formed, so NCCL's transport is built here without a GPU."""
    transport = make_transport("nccl", worker_extra(), "127.0.0.1", torch.device(device), setting)
    assert isinstance(transport, TorchDistTransport)
    assert transport.backend == backend


def test_the_connector_reports_its_data_path_in_its_first_stats_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    config = vllm_config(kv_transfer_config(settings(Connector.PYNCCL, Role.PREFILL), "engine-a"))
    cache = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    connector: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, cache)
    assert connector.get_kv_connector_stats() is None  # no caches yet: no path to report
    monkeypatch.setenv(DATA_PATH_ENV, "pinned-host")
    worker = ConnectorWorker(worker_extra(), GEOMETRY, WorkerIdentity(0, receives=False), "nccl")
    worker.register_kv_caches(make_caches(None), NUM_BLOCKS)
    connector._worker = worker  # what register_kv_caches sets from vLLM's model config (none here)
    try:
        first = connector.get_kv_connector_stats()
        assert first is not None
        assert first.data["data_path"] == "pinned-host"
        assert first.data["data_path_transport"] == "torch.distributed (gloo)"
        assert "pinned-host staging" in first.data["data_path_reason"]
        assert connector.get_kv_connector_stats() is None  # once: nothing else changed
    finally:
        worker.close()


def test_decodes_side_channel_is_sized_from_vllms_max_num_seqs() -> None:
    """NEW-7's wiring: vLLM's --max-num-seqs reaches decode's side channel through the connector vLLM
    makes (an engine running 300 requests at once has room for 300 offers waiting for their claims)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    config = vllm_config(kv_transfer_config(settings(Connector.MOONCAKE, Role.DECODE), "engine-d"))
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_port = consecutive_free_ports(1)
    config.scheduler_config.max_num_seqs = 300
    cache = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[])
    connector: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, cache)
    worker = ConnectorWorker(worker_extra(), GEOMETRY, connector._identity, "mooncake")
    worker.register_kv_caches(make_caches(None), NUM_BLOCKS)
    try:
        assert worker.receiver is not None
        assert worker.receiver.slots == connections_for(300, 1) == 300
    finally:
        worker.close()
