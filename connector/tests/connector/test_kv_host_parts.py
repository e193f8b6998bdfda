"""The `host` override on a device cache encodes on host cores (gpu-review item 16): where the staging is
host memory and the cache is not, each gathered layer is copied to the host before the codec sees it.
The CUDA half of this (the bytes equal the host kernels' on a GPU cache) is in
test_kv_data_path_cuda.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest
import torch
from data_path_cases import DST_BLOCKS, RELATIVE_ERROR, SRC_BLOCKS, decode, relative_error
from kv_peer import GEOMETRY, HOST, LAYERS, NUM_BLOCKS, make_caches, receiver_config

from dllm_connector.layout import PagedKV
from dllm_connector.pipe import chunk_encoder
from dllm_connector.pipe.common import chunk_ranges
from dllm_connector.pipe.host_parts import encodes_on_host, parts_on_host
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import PathSetting
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

CPU, GPU = torch.device("cpu"), torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("kv_device", "staging_device", "on_host"),
    [(GPU, CPU, True), (CPU, CPU, False), (GPU, GPU, False), (CPU, GPU, False)],
)
def test_only_a_device_cache_staged_in_host_memory_is_copied_to_the_host_first(
    kv_device: torch.device, staging_device: torch.device, on_host: bool
) -> None:
    assert encodes_on_host(kv_device, staging_device) is on_host


def test_each_part_arrives_on_the_host_in_one_reused_buffer_grown_for_a_larger_part() -> None:
    parts = [torch.randn(4, 2, 16, 8).to(torch.bfloat16) for _ in range(3)] + [torch.randn(8, 2, 16, 8)]
    seen = []
    for given, taken in zip(parts, parts_on_host(iter(parts)), strict=True):
        assert taken.device.type == "cpu"
        assert taken.dtype == given.dtype
        assert torch.equal(taken, given)
        assert taken.data_ptr() != given.data_ptr()  # a copy: the gather's buffer is reused too
        seen.append(taken.data_ptr())
    assert seen[0] == seen[1] == seen[2]  # same size: the same buffer


def test_the_sender_routes_a_device_caches_layers_through_the_host_before_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sender and receiver in this process over Mooncake (TCP), host path, int8. The cache here is on the
    CPU, so a double stands in for the device decision (it says "a device cache staged on the host");
    a spy counts the layers that went through `parts_on_host`; the blocks land as sent."""
    copied: list[int] = []

    def device_cache_on_host_staging_double(kv_device: torch.device, staging_device: torch.device) -> bool:
        return staging_device.type == "cpu"

    def counting_spy(parts: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        for part in parts_on_host(parts):
            copied.append(part.numel())
            yield part

    monkeypatch.setattr(chunk_encoder, "encodes_on_host", device_cache_on_host_staging_double)
    monkeypatch.setattr(chunk_encoder, "parts_on_host", counting_spy)
    config = receiver_config(data_path=PathSetting.HOST, compression=Compression.INT8, async_transfer=False)
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver, kv = decode(
        decode_transport, PathSetting.HOST, compression=Compression.INT8, async_transfer=False
    )
    sender = KVSender(prefill_transport, PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY), config)
    try:
        receiver.expect("host", DST_BLOCKS)
        sender.submit(SendJob("host", tuple(SRC_BLOCKS), HOST, receiver.port))
        assert receiver.wait_for("host", 30) == ""
        assert sender.finished()["host"] is None
        chunks = len(chunk_ranges(len(SRC_BLOCKS), sender._chunk_blocks(len(SRC_BLOCKS))))
        assert len(copied) == chunks * LAYERS
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        assert relative_error(kv.gather(DST_BLOCKS), want) <= RELATIVE_ERROR[Compression.INT8]
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()
