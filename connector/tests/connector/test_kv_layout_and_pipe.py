"""Paged-layout addressing, the staging buffer's back-pressure, pipe settings and the seed tensor API."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kv_peer import HOST, pipe_config
from pydantic import ValidationError

from dllm_connector.codec.checksum import spans_checksum
from dllm_connector.layout import Geometry, LayoutError, PagedKV, layer_layout
from dllm_connector.layout.span_table import merged
from dllm_connector.pipe.common import PipeConfig, chunk_ranges, gb
from dllm_connector.pipe.sender import KVSender
from dllm_connector.pipe.staging_window import StagingWindow
from dllm_connector.pipe.tensor_api import KVPipe
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.staging import StagingBuffer
from dllm_contract import kvconfig
from dllm_contract.kvconfig import Compression, ConnectorExtraConfig, Protocol

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

GEOMETRY = Geometry(block_size=16, num_kv_heads=4, head_dim=32)
NUM_BLOCKS = 10


@pytest.mark.parametrize(
    ("shape", "block_dim", "segments", "groups"),
    [
        ((NUM_BLOCKS, 4, 16, 64), 0, 1, 8),  # CPU: per head K rows then V rows
        ((2, NUM_BLOCKS, 16, 4, 32), 1, 2, 4),  # GPU flash NHD, K and V apart, gathered per head
        ((2, NUM_BLOCKS, 4, 16, 32), 1, 2, 4),  # GPU HND
        ((NUM_BLOCKS, 2, 16, 4, 32), 0, 1, 8),  # block-major NHD, gathered per (K or V, head)
        ((NUM_BLOCKS, 2, 4, 16, 32), 0, 1, 8),  # block-major HND
    ],
)
def test_layouts_are_read_from_shapes(
    shape: tuple[int, ...], block_dim: int, segments: int, groups: int
) -> None:
    layout = layer_layout(torch.zeros(shape), NUM_BLOCKS, GEOMETRY)
    assert (layout.block_dim, layout.segments, layout.groups) == (block_dim, segments, groups)


@pytest.mark.parametrize("shape", [(NUM_BLOCKS, 4, 16, 64), (2, NUM_BLOCKS, 16, 4, 32)])
def test_gather_scatter_and_regions_agree(shape: tuple[int, ...]) -> None:
    source = PagedKV({"a": torch.randn(shape), "b": torch.randn(shape)}, NUM_BLOCKS, GEOMETRY)
    target = PagedKV({"a": torch.zeros(shape), "b": torch.zeros(shape)}, NUM_BLOCKS, GEOMETRY)
    batch = source.gather([7, 2, 5])
    target.scatter([0, 9, 4], batch)
    assert torch.equal(target.gather([0, 9, 4]), batch)
    assert not bool(target.gather([1, 2, 3]).any())
    # spans list memory; a token-major cache gathers its heads outermost (scale groups per head)
    memory_order = batch.transpose(-3, -2).contiguous() if source.layout.heads_outermost else batch
    flat = memory_order.reshape(-1).view(torch.uint8)
    spans = source.spans([7, 2, 5])
    assert sum(length for _, length in spans) == flat.numel()
    copied = torch.cat([torch.frombuffer(_memory(addr, length), dtype=torch.uint8) for addr, length in spans])
    assert torch.equal(copied, flat)
    assert spans_checksum(spans) == spans_checksum([(flat.data_ptr(), flat.numel())])


@pytest.mark.parametrize("shape", [(NUM_BLOCKS, 4, 16, 64), (2, NUM_BLOCKS, 16, 4, 32)])
def test_layer_by_layer_gather_and_scatter_match_the_whole_batch(shape: tuple[int, ...]) -> None:
    source = PagedKV({"a": torch.randn(shape), "b": torch.randn(shape)}, NUM_BLOCKS, GEOMETRY)
    target = PagedKV({"a": torch.zeros(shape), "b": torch.zeros(shape)}, NUM_BLOCKS, GEOMETRY)
    whole = source.gather([7, 2, 5])
    parts = [part.clone() for part in source.gather_layers([7, 2, 5])]  # one buffer, reused
    assert torch.equal(torch.cat(parts), whole)
    target.scatter_layers([0, 9, 4], iter(parts))
    assert torch.equal(target.gather([0, 9, 4]), whole)
    assert not bool(target.gather([1, 2, 3]).any())


@pytest.mark.parametrize(
    ("shape", "geometry"),
    [
        ((NUM_BLOCKS, 4, 16, 64), GEOMETRY),  # 128-byte rows: moved as 16-byte elements
        ((NUM_BLOCKS, 4, 16, 6), Geometry(block_size=16, num_kv_heads=4, head_dim=3)),  # 12-byte rows
    ],
)
def test_scatter_places_every_bit_pattern_exactly(shape: tuple[int, ...], geometry: Geometry) -> None:
    """Codec none carries NaN payloads, infs and signed zeros as they are, whichever way a block moves."""
    patterns = torch.randint(-(1 << 15), 1 << 15, (NUM_BLOCKS, *shape[1:]), dtype=torch.int16)
    source = PagedKV({"a": patterns.view(torch.bfloat16)}, NUM_BLOCKS, geometry)
    target = PagedKV({"a": torch.zeros(shape, dtype=torch.bfloat16)}, NUM_BLOCKS, geometry)
    assert bool(source.gather(range(NUM_BLOCKS)).isnan().any())
    target.scatter([4, 0, 9, 1], source.gather([1, 3, 5, 8]))
    assert torch.equal(target.caches[0][[4, 0, 9, 1]].view(torch.int16), patterns[[1, 3, 5, 8]])
    assert not bool(target.caches[0][[2, 3, 5, 6, 7, 8]].view(torch.int16).any())


def test_a_batch_with_too_few_layers_is_refused_by_name() -> None:
    shape = (NUM_BLOCKS, 4, 16, 64)
    target = PagedKV({"a": torch.zeros(shape), "b": torch.zeros(shape)}, NUM_BLOCKS, GEOMETRY)
    one_layer = PagedKV({"a": torch.randn(shape)}, NUM_BLOCKS, GEOMETRY).gather_layers([1])
    with pytest.raises(LayoutError, match="KV batch held 1 layers, this engine has 2"):
        target.scatter_layers([3], one_layer)


def _memory(addr: int, length: int) -> bytearray:
    return bytearray((ctypes.c_ubyte * length).from_address(addr))


def test_spans_contiguous_on_both_sides_merge() -> None:
    src = torch.tensor([100, 110, 200, 210])
    dst = torch.tensor([500, 510, 520, 900])
    runs = merged(src, dst, torch.full((4,), 10))
    assert [part.tolist() for part in runs] == [[100, 200, 210], [500, 520, 900], [20, 10, 10]]


def test_non_contiguous_blocks_are_refused() -> None:
    strided = torch.zeros(NUM_BLOCKS, 64, 16, 4).transpose(1, 3)
    with pytest.raises(LayoutError, match="a block is not contiguous"):
        layer_layout(strided, NUM_BLOCKS, GEOMETRY)


def test_missing_block_axis_is_refused() -> None:
    with pytest.raises(LayoutError, match="no block axis of size 10"):
        layer_layout(torch.zeros(3, 4, 16, 64), NUM_BLOCKS, GEOMETRY)


def test_out_of_range_block_ids_are_refused() -> None:
    kv = PagedKV({"a": torch.zeros(NUM_BLOCKS, 4, 16, 64)}, NUM_BLOCKS, GEOMETRY)
    with pytest.raises(LayoutError, match=r"block ids outside 0\.\.9"):
        kv.gather([3, 10])


def test_layers_with_different_layouts_are_refused() -> None:
    caches = {
        "a": torch.zeros(NUM_BLOCKS, 4, 16, 64),
        "b": torch.zeros(NUM_BLOCKS, 4, 16, 64, dtype=torch.half),
    }
    with pytest.raises(LayoutError, match="share one KV layout and dtype"):
        PagedKV(caches, NUM_BLOCKS, GEOMETRY)


def test_staging_applies_back_pressure_until_space_is_released() -> None:
    staging = StagingBuffer(1024)
    first = staging.reserve(700, timeout=1)
    released = threading.Timer(0.2, staging.release, args=(first,))
    released.start()
    started = time.monotonic()
    second = staging.reserve(700, timeout=5)
    assert time.monotonic() - started >= 0.15
    staging.release(second)
    assert staging.in_use == 0


def test_a_payload_that_fits_the_staging_is_one_reservation_with_every_slot() -> None:
    staging = StagingBuffer(1024)
    window = StagingWindow(staging, [128] * 4, timeout=1)
    slots = window.slots()
    assert [index for index, _ in slots] == [0, 1, 2, 3]
    assert [addr - slots[0][1] for _, addr in slots] == [0, 128, 256, 384]
    assert window.decoded(0) == []
    window.release()
    assert staging.in_use == 0


def test_a_staging_window_waits_for_room_only_while_it_holds_no_slot() -> None:
    """A payload larger than the buffer: a window of at most half of it, refilled as batches are
    decoded. Holding a slot, it never waits for more (other windows may hold the rest)."""
    staging = StagingBuffer(1024)
    others = staging.reserve(896, timeout=1)
    window = StagingWindow(staging, [128] * 10, timeout=0.5)  # only 128 bytes free: one slot, no wait
    assert [index for index, _ in window.slots()] == [0]
    staging.release(others)
    assert [index for index, _ in window.decoded(0)] == [1, 2, 3, 4]  # half the buffer
    others = staging.reserve(staging.capacity - staging.in_use, timeout=1)  # the buffer is full
    slots = [index for batch in range(1, 6) for index, _ in window.decoded(batch)]
    assert slots == [5, 6, 7, 8, 9]  # each decoded batch's room goes to the next one
    staging.release(others)
    assert all(window.decoded(batch) == [] for batch in range(6, 10))
    window.release()
    assert staging.in_use == 0


def test_full_staging_times_out_and_oversize_is_refused() -> None:
    staging = StagingBuffer(1024)
    held = staging.reserve(1000, timeout=1)
    with pytest.raises(TransferTimeout, match="staging buffer full"):
        staging.reserve(100, timeout=0.05)
    with pytest.raises(TransportError, match="exceed the 1024-byte staging buffer"):
        staging.reserve(2048, timeout=1)
    staging.release(held)
    with pytest.raises(TransportError, match="no staging reservation"):
        staging.release(held)


def test_pipe_config_honours_the_connector_extra_config() -> None:
    extra = ConnectorExtraConfig(
        compression=Compression.INT8,
        buffer_size_gb=0.5,
        transfer_threshold_tokens=256,
        transfer_timeout_ms=2500,
        prefill_wait_ms=30000,
        hold_seconds=120,
        async_transfer=False,
        protocol=Protocol.TCP,
    )
    config = PipeConfig(extra=extra)
    in_pipe_units = (
        config.compression,
        config.buffer_bytes,
        config.transfer_timeout_s,
        config.prefill_wait_s,
        config.hold_s,
        config.async_transfer,
        config.threshold_tokens,
    )
    assert in_pipe_units == (Compression.INT8, 1 << 29, 2.5, 30.0, 120.0, False, 256)


def test_pipe_config_defaults_and_bounds_are_the_contracts() -> None:
    config = PipeConfig()
    assert config.buffer_bytes == int(kvconfig.DEFAULT_BUFFER_SIZE_GB * (1 << 30))
    assert config.transfer_timeout_s == kvconfig.DEFAULT_TRANSFER_TIMEOUT_MS / 1000
    assert config.prefill_wait_s == kvconfig.DEFAULT_PREFILL_WAIT_MS / 1000
    assert config.hold_s == kvconfig.DEFAULT_HOLD_SECONDS
    assert config.threshold_tokens == kvconfig.DEFAULT_TRANSFER_THRESHOLD_TOKENS
    assert config.with_extra(buffer_size_gb=gb(1024)).buffer_bytes == 1024  # any whole size, exactly
    with pytest.raises(ValidationError, match="hold_seconds"):
        config.with_extra(hold_seconds=0.5)


def test_prompt_hash_tells_token_sequences_apart() -> None:
    assert prompt_hash([1, 2, 3]) == prompt_hash([1, 2, 3])
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeTransport]:
    engine = MooncakeTransport(HOST)
    yield engine
    engine.close()


@pytest.mark.parametrize(("threshold", "blocks"), [(1024, 64), (256, 16), (20, 2), (1, 1)])
def test_transfers_move_in_batches_of_the_threshold(
    mooncake: MooncakeTransport, threshold: int, blocks: int
) -> None:
    kv = PagedKV({"a": torch.zeros(NUM_BLOCKS, 4, 16, 64)}, NUM_BLOCKS, GEOMETRY)
    sender = KVSender(mooncake, kv, pipe_config(buffer_size_gb=gb(1024), transfer_threshold_tokens=threshold))
    try:
        assert sender._chunk_blocks(1000) == blocks
        assert sender._chunk_blocks(3) == min(blocks, 3)  # never more than the transfer (L3)
    finally:
        sender.close()
    assert chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("compression", list(Compression))
def test_seed_api_moves_a_tensor(mooncake: MooncakeTransport, compression: Compression) -> None:
    kv = torch.randn(32, 2, 16, 64, dtype=torch.bfloat16)
    config = pipe_config(
        compression=compression, buffer_size_gb=gb(8 << 20), transfer_timeout_ms=5000, prefill_wait_ms=10_000
    )
    decode = KVPipe(mooncake, config, host=HOST, port=0).receiver_for(kv)
    try:
        port = decode.receiver.port
        sent: list[bool] = []
        pipe = KVPipe(mooncake, config, host=HOST, port=0)
        sender = threading.Thread(
            target=lambda: sent.append(pipe.send_kv_cache("r-1", kv, {"host": HOST, "port": port}))
        )
        sender.start()
        received = decode.receive_kv_cache("r-1", timeout=20)
        sender.join(timeout=20)
    finally:
        decode.close()
    assert sent == [True]
    assert received is not None
    error = float((received.float() - kv.float()).norm() / kv.float().norm())
    assert error <= {Compression.NONE: 0.0, Compression.FP8: 0.04, Compression.INT8: 0.01}[compression]


def test_seed_api_receive_times_out_with_none(mooncake: MooncakeTransport) -> None:
    like = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    config = pipe_config(buffer_size_gb=gb(1 << 28), prefill_wait_ms=30_000)
    decode = KVPipe(mooncake, config, host=HOST, port=0).receiver_for(like)
    try:
        started = time.monotonic()
        assert decode.receive_kv_cache("r-late", timeout=0.3) is None
        assert time.monotonic() - started < 2
        assert not decode.receiver.pending
    finally:
        decode.close()
