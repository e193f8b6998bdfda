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
from dllm_connector.pipe import chunk_encoder, host_parts
from dllm_connector.pipe.common import chunk_ranges
from dllm_connector.pipe.host_parts import PinnedParts, encodes_on_host
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import PathSetting
from dllm_connector.transport.staging import pinned_host_bytes
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
    for given, taken in zip(parts, PinnedParts().copied(iter(parts)), strict=True):
        assert taken.device.type == "cpu"
        assert taken.dtype == given.dtype
        assert torch.equal(taken, given)
        assert taken.data_ptr() != given.data_ptr()  # a copy: the gather's buffer is reused too
        seen.append(taken.data_ptr())
    assert seen[0] == seen[1] == seen[2]  # same size: the same buffer


def test_the_next_chunk_reuses_the_buffer_and_two_chunks_at_once_get_one_each() -> None:
    pool, part = PinnedParts(), torch.randn(2, 16, 8)
    first = [taken.data_ptr() for taken in pool.copied([part, part])]
    again = [taken.data_ptr() for taken in pool.copied([part])]
    assert again[0] == first[0]  # pinned once, for the sender's life
    one, other = pool.copied([part]), pool.copied([part])
    assert next(one).data_ptr() != next(other).data_ptr()  # two sends in flight never share one


def test_the_sender_routes_a_device_caches_layers_through_the_host_before_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sender and receiver in this process over Mooncake (TCP), host path, int8. The cache here is on the
    CPU, so a double stands in for the device decision (it says "a device cache staged on the host");
    a spy counts the layers that went through the host copies and the page-locked buffers made for
    them (one, for every chunk of the transfer); the blocks land as sent."""
    copied: list[int] = []
    pinned: list[int] = []

    def device_cache_on_host_staging_double(kv_device: torch.device, staging_device: torch.device) -> bool:
        return staging_device.type == "cpu"

    copy_parts = PinnedParts.copied

    def counting_spy(pool: PinnedParts, parts: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        for part in copy_parts(pool, parts):
            copied.append(part.numel())
            yield part

    def pinning_spy(nbytes: int) -> tuple[torch.Tensor, str]:
        pinned.append(nbytes)
        return pinned_host_bytes(nbytes)

    monkeypatch.setattr(chunk_encoder, "encodes_on_host", device_cache_on_host_staging_double)
    monkeypatch.setattr(PinnedParts, "copied", counting_spy)
    monkeypatch.setattr(host_parts, "pinned_host_bytes", pinning_spy)
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
        assert chunks > 1
        assert len(copied) == chunks * LAYERS
        assert len(pinned) == 1, pinned
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        assert relative_error(kv.gather(DST_BLOCKS), want) <= RELATIVE_ERROR[Compression.INT8]
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()
