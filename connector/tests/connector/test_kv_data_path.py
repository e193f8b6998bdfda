"""The data-path decision (transport.placement): every case of the table, the bad overrides and
settings, and the traits the transports report to it.

Pure: no cache, staging or transfer is made here (the parts are in test_kv_data_path_parts.py, the
worker's use of the decision in test_kv_data_path_worker.py).
"""

from __future__ import annotations

import pytest

from dllm_connector.transport.mooncake import cuda_build, mooncake_traits
from dllm_connector.transport.placement import (
    DataPath,
    DataPathError,
    PathSetting,
    TransportTraits,
    choose_path,
    parse_setting,
)
from dllm_contract.kvconfig import Compression

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


@pytest.mark.parametrize(
    ("protocol", "cuda", "device"), [("tcp", True, True), ("rdma", True, True), ("tcp", False, False)]
)
def test_the_check_switch_takes_the_device_path_over_tcp_where_mooncake_copies_device_memory(
    protocol: str, cuda: bool, device: bool
) -> None:
    """DLLM_KV_TCP_DEVICE=1 (gpu-review item 17): two engines on one GPU take the device path over TCP
    with Mooncake's CUDA build, never with a build that cannot read device memory."""
    traits = mooncake_traits(protocol, cuda_build=cuda, tcp_device=True)
    assert traits.registers_device_memory is device
    placed = choose_path("cuda", Compression.FP8, traits)
    assert placed.path is (DataPath.DEVICE if device else DataPath.PINNED_HOST)
    if protocol == "tcp" and cuda:
        assert "DLLM_KV_TCP_DEVICE=1" in placed.reason


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
