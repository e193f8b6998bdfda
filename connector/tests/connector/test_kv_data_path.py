"""The data-path decision (transport.placement): every case of the table, and the bad overrides."""

from __future__ import annotations

import ctypes
import functools
import logging
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from kv_peer import GEOMETRY, NUM_BLOCKS, make_caches, rank_kv
from vllm_plugin_cases import settings, vllm_config

from dllm_connector import codec
from dllm_connector.codec.device_checksum import tensor_checksum
from dllm_connector.connector import DATA_PATH_METRIC, DllmConnectorStats, DllmMooncakeConnector
from dllm_connector.layout import TPRank
from dllm_connector.pipe.chunk_writer import ChunkWriter, Plan, PreparedChunk, PreparedPiece
from dllm_connector.pipe.device_copy import Copies, HostMirror, Scratch
from dllm_connector.pipe.span_checksum import chunk_checksum
from dllm_connector.transport.base import Source, Span, Transport, TransportError
from dllm_connector.transport.mooncake import cuda_build, mooncake_traits
from dllm_connector.transport.placement import (
    DataPath,
    DataPathError,
    PathSetting,
    TransportTraits,
    choose_path,
    parse_setting,
)
from dllm_connector.transport.staging import StagingBuffer
from dllm_connector.transport.torchdist import TorchDistTransport
from dllm_connector.tuning import ENV_NAMES, TuningInvalid
from dllm_connector.worker import ConnectorWorker, WorkerIdentity, make_transport
from dllm_contract.kvconfig import Compression, Connector, ConnectorExtraConfig, Role, kv_transfer_config

DATA_PATH_ENV = ENV_NAMES["data_path"]
MOONCAKE_CUDA = TransportTraits("mooncake (rdma)", one_sided=True, registers_device_memory=True)
MOONCAKE_TCP_NO_CUDA = TransportTraits(
    "mooncake (tcp)", one_sided=True, registers_device_memory=False, why_not_device="built without CUDA"
)
NCCL = TransportTraits(
    "torch.distributed (nccl)", one_sided=False, registers_device_memory=True, moves_host_memory=False
)
GLOO = TransportTraits(
    "torch.distributed (gloo)", one_sided=False, registers_device_memory=False, why_not_device="gloo"
)
NONE, FP8 = Compression.NONE, Compression.FP8
AUTO, DEVICE, PINNED, HOST = PathSetting.AUTO, PathSetting.DEVICE, PathSetting.PINNED_HOST, PathSetting.HOST

# (cache device, codec, transport, setting) -> (path, cache registered, zero-copy)
TABLE = [
    # GPU caches, auto: device where the transport takes device memory, else pinned host
    ("cuda", NONE, MOONCAKE_CUDA, AUTO, DataPath.DEVICE, True, True),
    ("cuda", FP8, MOONCAKE_CUDA, AUTO, DataPath.DEVICE, True, False),
    ("cuda", NONE, NCCL, AUTO, DataPath.DEVICE, True, False),
    ("cuda", FP8, NCCL, AUTO, DataPath.DEVICE, True, False),
    ("cuda", NONE, MOONCAKE_TCP_NO_CUDA, AUTO, DataPath.PINNED_HOST, False, False),
    ("cuda", FP8, MOONCAKE_TCP_NO_CUDA, AUTO, DataPath.PINNED_HOST, False, False),
    ("cuda", NONE, GLOO, AUTO, DataPath.PINNED_HOST, False, False),
    # GPU caches, overridden
    ("cuda", NONE, MOONCAKE_CUDA, PINNED, DataPath.PINNED_HOST, False, False),
    ("cuda", NONE, MOONCAKE_CUDA, HOST, DataPath.HOST, False, False),
    ("cuda", FP8, NCCL, DEVICE, DataPath.DEVICE, True, False),
    ("cuda", NONE, GLOO, HOST, DataPath.HOST, False, False),
    ("cuda", FP8, GLOO, PINNED, DataPath.PINNED_HOST, False, False),
    # CPU caches: today's host path, zero-copy for none over a one-sided transport
    ("cpu", NONE, MOONCAKE_TCP_NO_CUDA, AUTO, DataPath.HOST, True, True),
    ("cpu", FP8, MOONCAKE_TCP_NO_CUDA, AUTO, DataPath.HOST, True, False),
    ("cpu", NONE, GLOO, AUTO, DataPath.HOST, True, False),
    ("cpu", NONE, NCCL, DEVICE, DataPath.DEVICE, True, False),
    # CPU caches forced onto the device code (how this machine tests it) or the pinned-host code
    ("cpu", NONE, MOONCAKE_TCP_NO_CUDA, DEVICE, DataPath.DEVICE, True, True),
    ("cpu", FP8, GLOO, DEVICE, DataPath.DEVICE, True, False),
    ("cpu", NONE, MOONCAKE_TCP_NO_CUDA, PINNED, DataPath.PINNED_HOST, False, False),
    ("cpu", FP8, GLOO, PINNED, DataPath.PINNED_HOST, False, False),
    ("cpu", NONE, MOONCAKE_TCP_NO_CUDA, HOST, DataPath.HOST, True, True),
]


@pytest.mark.parametrize(
    ("device", "codec", "transport", "setting", "path", "registered", "zero_copy"), TABLE
)
def test_every_case_of_the_table(
    device: str,
    codec: Compression,
    transport: TransportTraits,
    setting: PathSetting,
    path: DataPath,
    registered: bool,
    zero_copy: bool,
) -> None:
    placement = choose_path(device, codec, transport, setting)
    assert (placement.path, placement.cache_registered, placement.zero_copy) == (path, registered, zero_copy)
    assert placement.reason
    assert placement.describe().startswith(path.value)


def test_the_reason_names_the_transport_and_why_it_cannot_take_device_memory() -> None:
    placement = choose_path("cuda", NONE, MOONCAKE_TCP_NO_CUDA)
    assert "mooncake (tcp)" in placement.reason
    assert "built without CUDA" in placement.reason
    assert "pinned" in placement.reason
    assert "no host copy" in choose_path("cuda", NONE, MOONCAKE_CUDA).reason
    assert "host memory" in choose_path("cpu", NONE, GLOO).reason
    assert "CPU tensors" in choose_path("cpu", NONE, GLOO, DEVICE).reason


def test_device_override_a_transport_cannot_honour_is_refused_by_name() -> None:
    with pytest.raises(
        DataPathError, match=r"torch.distributed \(gloo\) cannot register cuda memory \(gloo\)"
    ):
        choose_path("cuda", FP8, GLOO, DEVICE)
    with pytest.raises(DataPathError, match="built without CUDA"):
        choose_path("cuda", NONE, MOONCAKE_TCP_NO_CUDA, DEVICE)


@pytest.mark.parametrize(("device", "setting"), [("cuda", HOST), ("cuda", PINNED), ("cpu", AUTO)])
def test_host_staging_over_nccl_is_refused(device: str, setting: PathSetting) -> None:
    """NCCL moves device tensors only: host staging needs gloo (the worker picks it, worker)."""
    with pytest.raises(DataPathError, match=r"host memory, which torch.distributed \(nccl\) cannot move"):
        choose_path(device, NONE, NCCL, setting)


@pytest.mark.parametrize(
    ("raw", "setting"),
    [(None, AUTO), ("", AUTO), ("auto", AUTO), (" Device ", DEVICE), ("pinned-host", PINNED), ("host", HOST)],
)
def test_settings_parse(raw: str | None, setting: PathSetting) -> None:
    assert parse_setting(raw) is setting


@pytest.mark.parametrize("raw", ["gpu", "pinned", "device;rm -rf"])
def test_unknown_settings_are_refused_with_the_choices(raw: str) -> None:
    with pytest.raises(DataPathError, match="expected one of auto, device, pinned-host, host"):
        parse_setting(raw)


@pytest.mark.parametrize(
    ("distributions", "cuda"),
    [
        (["mooncake-transfer-engine"], True),
        (["mooncake_transfer_engine_cuda13"], True),
        (["mooncake-transfer-engine-non-cuda"], False),
        (["mooncake_transfer_engine_non_cuda"], False),
        ([], False),
    ],
)
def test_mooncake_cuda_build_is_told_by_its_wheel(distributions: list[str], cuda: bool) -> None:
    assert cuda_build(distributions) is cuda


@pytest.mark.parametrize(
    ("protocol", "cuda", "device", "why"),
    [
        ("rdma", True, True, ""),
        ("tcp", True, False, "over TCP Mooncake copies device memory through host buffers itself"),
        ("rdma", False, False, "a build without CUDA"),
        ("tcp", False, False, "a build without CUDA"),
    ],
)
def test_mooncake_registers_device_memory_only_where_the_nic_reads_it(
    protocol: str, cuda: bool, device: bool, why: str
) -> None:
    """The image's CUDA build over TCP stages in pinned host memory (review of issue 20, finding 1)."""
    traits = mooncake_traits(protocol, cuda_build=cuda)
    assert traits.registers_device_memory is device
    assert why in traits.why_not_device
    placed = choose_path("cuda", Compression.NONE, traits)
    assert placed.path is (DataPath.DEVICE if device else DataPath.PINNED_HOST)


def test_transports_describe_themselves() -> None:
    """The real transports here: Mooncake's non-CUDA wheel over TCP, gloo; NCCL by its traits alone."""
    from dllm_connector.transport.mooncake import MooncakeTransport
    from dllm_connector.transport.torchdist import TorchDistTransport

    mooncake = MooncakeTransport("127.0.0.1")
    try:
        traits = mooncake.traits()
    finally:
        mooncake.close()
    assert (traits.kind, traits.one_sided, traits.registers_device_memory) == ("mooncake (tcp)", True, False)
    assert "without CUDA" in traits.why_not_device
    gloo = TorchDistTransport("127.0.0.1", backend="gloo").traits()
    assert (gloo.kind, gloo.one_sided, gloo.registers_device_memory) == (
        "torch.distributed (gloo)",
        False,
        False,
    )


# ---- what the decision places: staging, copies, the worker's report ------------------------------


def worker_extra() -> ConnectorExtraConfig:
    settings_ = settings(Connector.PYNCCL, Role.PREFILL)
    return ConnectorExtraConfig.model_validate(
        kv_transfer_config(settings_, "e")["kv_connector_extra_config"]
    )


def test_pinned_staging_without_an_accelerator_is_plain_host_memory_and_says_so() -> None:
    staging = StagingBuffer(1 << 16, pinned=True)
    assert staging.device.type == "cpu"
    assert "plain host memory" in staging.note
    assert StagingBuffer(1 << 16).note == ""


def test_a_pinned_buffer_on_a_device_is_refused() -> None:
    with pytest.raises(TransportError, match="a pinned staging buffer is host memory, not cuda"):
        StagingBuffer(1 << 16, device=torch.device("cuda"), pinned=True)


def test_a_host_mirror_copies_ranges_each_way() -> None:
    """The pinned-host path's copies, synchronous on the CPU: each range lands once it is ready."""
    copies = Copies(torch.device("cpu"))
    work = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:1000].clone()
    host = torch.zeros(1000, dtype=torch.uint8)
    mirror = HostMirror(work, host, copies)
    ready = mirror.to_host([(0, 100), (600, 1000)])
    ready()
    assert torch.equal(host[:100], work[:100])
    assert torch.equal(host[600:], work[600:])
    assert not bool(host[100:600].any())
    host[100:600] = 7
    mirror.to_device([(100, 600)])
    assert bool((work[100:600] == 7).all())
    copies.mark()()  # nothing queued on the CPU: ready at once
    with pytest.raises(ValueError, match="a 10-byte scratch cannot mirror 1000 bytes"):
        HostMirror(work[:10], host, copies)


def test_a_reservation_s_scratch_is_the_slice_at_its_own_offset() -> None:
    """One scratch as large as the staging, whatever the threads: a reservation's is at its offset."""
    staging = StagingBuffer(1 << 16, pinned=True)
    scratch = Scratch(staging, torch.device("cpu"))
    assert scratch.buffer.numel() == staging.capacity
    first, second = staging.reserve(4000, 1.0), staging.reserve(1000, 1.0)
    for view in (first, second, second[10:20]):
        work = scratch.take(view)
        assert work.numel() == view.numel()
        assert work.data_ptr() - scratch.buffer.data_ptr() == view.data_ptr() - staging.tensor.data_ptr()
    with pytest.raises(TransportError, match="are not in the staging buffer"):
        scratch.take(torch.empty(100, dtype=torch.uint8))


def _span_bytes(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The bytes at host addresses, in order (the test's own reading of a CPU cache)."""
    return torch.frombuffer(bytearray(b"".join(ctypes.string_at(a, n) for a, n in spans)), dtype=torch.uint8)


@pytest.mark.parametrize(
    ("layout", "heads"), [("cpu", None), ("cpu", (1, 3)), ("nhd", None), ("nhd", (2, 3))]
)
@pytest.mark.parametrize("max_bytes", [1, 5000, 1 << 30])
def test_gathered_layers_are_the_spans_bytes_in_the_same_order(
    layout: str, heads: tuple[int, int] | None, max_bytes: int
) -> None:
    """Gathered a layer at a time through a bounded buffer, a zero-copy chunk's blocks are the bytes
    its spans list, in order: the device checksum's value is that of the spans, and of the codec-none
    payload the same blocks gather into, whichever the bound."""
    kv = rank_kv(7, layout, TPRank(0, 2))
    blocks = [40, 3, 17, 95, 4, 5]
    runs = [run.clone() for run in kv.gathered_bytes(blocks, heads, range(1, 3), max_bytes)]
    per_block = kv.batch_nbytes(1, heads) // kv.num_layers
    assert all(run.numel() <= max(max_bytes // per_block, 1) * per_block for run in runs)
    assert torch.equal(torch.cat(runs), _span_bytes(kv.spans(blocks, heads, range(1, 3))))
    running = chunk_checksum(kv, codec.ChecksumAlgo.NH64, blocks, heads)
    running.add_layers(range(2))
    running.add_layers(range(2, kv.num_layers))
    whole = _span_bytes(kv.spans(blocks, heads))
    assert running.value == tensor_checksum(whole)
    payload = kv.gather(blocks, heads=heads).reshape(-1).view(torch.uint8)
    header = codec.KVHeader(
        Compression.NONE, kv.dtype_name, kv.batch_shape(len(blocks), heads), 1, 0, codec.ChecksumAlgo.NH64
    )
    assert running.value == codec.checksum(header, payload)


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
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()

    class PrivateGauge(Gauge):
        """Gauge on this test's registry (vLLM's is process-wide)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **(kwargs | {"registry": registry}))

    levels = {"data_path": "pinned-host", "data_path_transport": "mooncake (tcp)", "data_path_reason": "why"}
    workers = DllmConnectorStats(data={"sent": 2}).aggregate(DllmConnectorStats(data={"sent": 1} | levels))
    assert workers.reduce() == {"sent": 3} | levels  # the levels are kept, not summed
    metrics = DllmMooncakeConnector.build_prom_metrics(
        vllm_config(kv_transfer_config(settings(Connector.MOONCAKE, Role.PREFILL), "engine-a")),
        {Gauge: PrivateGauge, Counter: Counter, Histogram: Histogram},
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


class RecordingTransportDouble(Transport):
    """Test double: a one-sided transport that only records when it was asked to read a source,
    which no real transport reports (the order against the ready marks is what is tested)."""

    name = "recording"
    one_sided = True

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def register(self, tensor: torch.Tensor) -> None:
        return None

    def unregister(self, tensor: torch.Tensor) -> None:
        return None

    def endpoint(self) -> dict[str, Any]:
        return {}

    def send(
        self, peer: Mapping[str, Any], src: Sequence[Source], dst: Sequence[Span], tag: int, timeout: float
    ) -> None:
        self.events.append(f"write {dst[0].addr}")

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


def test_the_writer_reads_a_piece_only_once_its_copy_or_encode_is_done() -> None:
    """Pinned-host and device paths hand pieces over before the device finished them; the writer
    waits for each piece's (and chunk's) ready mark before the transport reads it."""
    events: list[str] = []
    ours, theirs = socket.socketpair()
    staging = StagingBuffer(1 << 12)
    plan = Plan(0, 1, 1, [], 1, {})
    writer = ChunkWriter(RecordingTransportDouble(events), 5.0, staging, ours, plan)
    try:
        for index in range(3):
            ready = functools.partial(events.append, f"ready {index}")
            writer.put(PreparedPiece([Span(1, 8)], [Span(100 + index, 8)], 0, index + 1, ready))
        header = codec.KVHeader(Compression.NONE, "bfloat16", (1, 4), 1, 0)
        staged = staging.reserve(8, 1.0)
        ready = functools.partial(events.append, "ready chunk")
        writer.put(PreparedChunk(0, header, [Span(1, 8)], [Span(200, 8)], staged, ready))
        writer.finish()
    finally:
        ours.close()
        theirs.close()
    assert events == [
        "ready 0",
        "write 100",
        "ready 1",
        "write 101",
        "ready 2",
        "write 102",
        "ready chunk",
        "write 200",
    ]
    assert staging.in_use == 0


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
