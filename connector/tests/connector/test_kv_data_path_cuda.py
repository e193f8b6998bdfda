"""The data paths on a CUDA device: the lines that only run there (pipe.device_copy's side stream and
events, page-locked staging) and a GPU KV moved between two processes. Skipped without CUDA (this
machine); run them where a GPU is lent:

    python -m pytest -q connector/tests/connector/test_kv_data_path_cuda.py

With Mooncake's non-CUDA wheel or gloo, a GPU cache takes the pinned-host path; with Mooncake's CUDA
build, the device path (zero-copy for codec none). Each test asserts which it took. The last runs
bench/gpu_check.py's pipe step: FlashAttention NHD, HND and MLA caches on both paths, each codec, the
device path forced over TCP on this one GPU (DLLM_KV_TCP_DEVICE=1, gpu-review item 17).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from data_path_cases import deliver_all
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, Prefill, make_caches, pipe_config

from dllm_connector import codec
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import gb
from dllm_connector.pipe.device_copy import Copies, HostMirror
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.base import Transport
from dllm_connector.transport.mooncake import MooncakeTransport, installed_cuda_build
from dllm_connector.transport.placement import DataPath, PathSetting, choose_path
from dllm_connector.transport.staging import StagingBuffer, pinned_host_bytes
from dllm_connector.transport.torchdist import _on_device_of
from dllm_contract.kvconfig import Compression

pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run where a GPU is lent)"),
]

CUDA = torch.device("cuda")
BENCH = Path(__file__).resolve().parents[3] / "bench"
SRC_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5))[:200]]
DST_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(6))[:200]]
RELATIVE_ERROR = {Compression.NONE: 0.0, Compression.FP8: 0.04}


def test_staging_is_page_locked_where_a_gpu_is() -> None:
    host, note = pinned_host_bytes(1 << 20)
    assert host.is_pinned()
    assert note == ""
    assert StagingBuffer(1 << 20, pinned=True).tensor.is_pinned()
    assert StagingBuffer(1 << 20, device=CUDA).device.type == "cuda"


def test_copies_on_the_side_stream_land_once_ready() -> None:
    """Written by a kernel on the current stream, copied on the side stream after it, both ways."""
    nbytes = 64 << 20
    work = torch.empty(nbytes, dtype=torch.uint8, device=CUDA)
    work.copy_(torch.arange(nbytes, device=CUDA) % 251)  # a kernel the copy must wait for
    host, _ = pinned_host_bytes(nbytes)
    mirror = HostMirror(work, host, Copies(CUDA))
    mirror.to_host([(0, nbytes // 2), (nbytes // 2, nbytes)])()
    assert torch.equal(host, work.cpu())
    host.fill_(3)
    mirror.to_device([(0, nbytes)])
    assert bool((work == 3).all())  # the current stream waited for the copy


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.FP8])
def test_gpu_kv_moves_between_two_processes(
    transport: Transport, prefill: Prefill, compression: Compression
) -> None:
    caches = {name: cache.to(CUDA) for name, cache in make_caches(None).items()}
    kv = PagedKV(caches, NUM_BLOCKS, GEOMETRY)
    config = pipe_config(
        compression=compression,
        buffer_size_gb=gb(64 << 20),
        transfer_timeout_ms=20_000,
        prefill_wait_ms=60_000,
    )
    receiver = KVReceiver(transport, kv, config, HOST, 0)
    try:
        want_path = choose_path("cuda", codec.effective_codec(compression, kv.dtype), transport.traits()).path
        assert receiver.placement.path is want_path
        receiver.expect("t-gpu", DST_BLOCKS)
        prefill.send(
            receiver.port,
            [{"transfer_id": "t-gpu", "block_ids": SRC_BLOCKS}],
            compression=compression.value,
            device="cuda",
            piece_bytes=1,  # a piece per layer: the copies overlap the wire
        )
        assert receiver.wait_for("t-gpu", timeout=120) == ""
        report = prefill.report()
        assert report[0] == {"transfer_id": "t-gpu", "error": None}
        assert report[-1]["data_path"] == want_path.value
        assert report[-1]["staging_in_use"] == 0
        assert receiver.staging.in_use == 0
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY).gather(SRC_BLOCKS)
        got = kv.gather(DST_BLOCKS).cpu()
        error = float((got.float() - want.float()).norm() / want.float().norm())
        assert error <= RELATIVE_ERROR[compression]
        if want_path is DataPath.PINNED_HOST:
            assert receiver.staging.tensor.is_pinned()
    finally:
        receiver.close()


def test_nccl_calls_run_on_the_tensors_device() -> None:
    """The writer's thread starts on cuda:0; a TP rank's staging may be on another GPU."""
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    with _on_device_of([torch.empty(1, device=last)]):
        assert torch.cuda.current_device() == last.index


def test_every_gpu_layout_moves_on_both_data_paths_with_each_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and decode sides on this GPU, each with its own Mooncake engine over TCP: decode's blocks
    hold prefill's (none byte for byte, fp8/int8 within their bounds) for every row. The device path
    needs Mooncake's CUDA build (`make gpu-check-bundle`); without it its rows say why they were skipped."""
    monkeypatch.setenv("DLLM_KV_TCP_DEVICE", "1")
    monkeypatch.syspath_prepend(str(BENCH))
    from gpu.pipe_layouts import pipe_rows

    rows = pipe_rows(CUDA, 2048, 4)
    assert len(rows) == 3 * 2 * 3, rows
    for row in rows:
        if row["path"] == "device" and not installed_cuda_build():
            assert "without CUDA" in row["skipped"], row
            continue
        assert row.get("ok") is True, row
        zero_copy = row["path"] == "device" and row["codec"] == "none"
        assert row["taken"] == f"{row['path']} ({'zero-copy for codec none' if zero_copy else 'staged'})"


def test_concurrent_transfers_work_on_streams_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu-review item 13: three fp8 sends and their loads at once, sides on this GPU, submitted from a
    thread on a pool stream as vLLM's worker is: every send and load runs on a stream the connector
    made, never the legacy default stream, never a pool stream (vLLM's among them), and every load
    lands within fp8's bound."""
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def recording(real: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            with lock:
                seen.append((threading.current_thread().name, torch.cuda.current_stream().cuda_stream))
            return real(self, *args)

        return run

    monkeypatch.setattr(KVSender, "send", recording(KVSender.send))
    monkeypatch.setattr(KVReceiver, "_receive", recording(KVReceiver._receive))
    config = pipe_config(
        compression=Compression.FP8,
        buffer_size_gb=gb(64 << 20),
        transfer_timeout_ms=20_000,
        prefill_wait_ms=60_000,
    )
    source = PagedKV({name: cache.to(CUDA) for name, cache in make_caches(7).items()}, NUM_BLOCKS, GEOMETRY)
    target = PagedKV(
        {name: cache.to(CUDA) for name, cache in make_caches(None).items()}, NUM_BLOCKS, GEOMETRY
    )
    pool = {torch.cuda.Stream().cuda_stream for _ in range(64)}  # type: ignore[no-untyped-call]  # all of it
    vllm_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver = KVReceiver(decode_transport, target, config, HOST, 0)
    sender = KVSender(prefill_transport, source, config)
    jobs = {f"s-{n}": (SRC_BLOCKS[n * 60 : n * 60 + 60], DST_BLOCKS[n * 60 : n * 60 + 60]) for n in range(3)}
    try:
        with torch.cuda.stream(vllm_stream):
            deliver_all(sender, receiver, jobs)
        assert sorted(name.split("-")[1] for name, _ in seen) == ["send"] * 3 + ["side"] * 3, seen
        streams = {stream for _, stream in seen}
        assert torch.cuda.default_stream().cuda_stream not in streams, seen
        assert not streams & (pool | {vllm_stream.cuda_stream}), seen
        want = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
        for src, dst in jobs.values():
            got, expected = target.gather(dst).cpu().float(), want.gather(src).float()
            assert float((got - expected).norm() / expected.norm()) <= RELATIVE_ERROR[Compression.FP8]
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


@pytest.mark.parametrize("compression", [Compression.FP8, Compression.INT8])
def test_the_host_override_on_a_gpu_cache_sends_the_host_kernels_bytes(compression: Compression) -> None:
    """gpu-review item 16: `host` encodes on host cores, so decode's blocks are exactly what the host's
    kernels make of prefill's (the byte-for-byte promise between engines on different paths)."""
    config = pipe_config(
        data_path=PathSetting.HOST,
        compression=compression,
        buffer_size_gb=gb(64 << 20),
        transfer_timeout_ms=20_000,
        prefill_wait_ms=60_000,
        hold_seconds=30,
    )
    source = PagedKV({name: cache.to(CUDA) for name, cache in make_caches(7).items()}, NUM_BLOCKS, GEOMETRY)
    target = PagedKV(
        {name: cache.to(CUDA) for name, cache in make_caches(None).items()}, NUM_BLOCKS, GEOMETRY
    )
    decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    receiver = KVReceiver(decode_transport, target, config, HOST, 0)
    sender = KVSender(prefill_transport, source, config)
    try:
        assert receiver.placement.path is DataPath.HOST
        receiver.expect("host-override", DST_BLOCKS)
        sender.submit(SendJob("host-override", tuple(SRC_BLOCKS), HOST, receiver.port))
        assert receiver.wait_for("host-override", 60) == ""
        assert sender.wait_idle(30)
        assert sender.finished()["host-override"] is None
        header, payload = codec.encode(source.gather(SRC_BLOCKS).cpu(), compression, source.layout.groups)
        assert torch.equal(target.gather(DST_BLOCKS).cpu(), codec.decode(header, payload))
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


@pytest.mark.parametrize("compression", [Compression.FP8, Compression.INT8])
def test_a_gpu_encodes_and_decodes_with_the_compiled_kernels_and_the_hosts_bytes(
    compression: Compression,
) -> None:
    """gpu-review item 14: payloads on the GPU take torch.compile's kernels (Triton), not plain ops'
    twenty launches a call, and they still write the host's C kernels' bytes."""
    assert codec.device_kernels(CUDA, torch.bfloat16).name == "compiled"
    source = PagedKV({name: cache.to(CUDA) for name, cache in make_caches(7).items()}, NUM_BLOCKS, GEOMETRY)
    batch = source.gather(SRC_BLOCKS)
    groups = source.layout.groups
    host_header, host_payload = codec.encode(batch.cpu(), compression, groups)
    out = torch.empty(host_payload.numel(), dtype=torch.uint8, device=CUDA)
    header, payload = codec.encode_parts(
        [batch],
        tuple(batch.shape),
        batch.dtype,
        compression,
        groups,
        out,
        checksum_algo=codec.ChecksumAlgo.NH64,
    )
    assert torch.equal(payload.cpu(), host_payload)
    assert torch.equal(codec.decode(header, payload).cpu(), codec.decode(host_header, host_payload))


@pytest.mark.parametrize("heads", [None, (1, 3)])
def test_the_zero_copy_checksum_reads_the_gpus_blocks_in_place_and_gets_the_gathers_value(
    heads: tuple[int, int] | None,
) -> None:
    """gpu-review item 14: the Triton kernel taking block ids serves on a GPU, and the zero-copy
    checksum it makes of a FlashAttention cache ([2, N, 16, 8, 128]: runs of 4096 words, or of 64 for
    a head range) equals the one the gather makes (the value a peer on the gather computes)."""
    from dllm_connector.codec.device_checksum import RunningTensorChecksum, blocks_in_place
    from dllm_connector.layout import Geometry
    from dllm_connector.pipe.span_checksum import DeviceChunkChecksum

    assert blocks_in_place(CUDA)
    geometry = Geometry(block_size=16, num_kv_heads=8, head_dim=128)
    caches = {f"l{i}": torch.randn(2, 256, 16, 8, 128, device=CUDA).to(torch.bfloat16) for i in range(3)}
    kv = PagedKV(caches, 256, geometry)
    blocks = [int(b) for b in torch.randperm(256, generator=torch.Generator().manual_seed(9))[:100]]
    in_place = DeviceChunkChecksum(kv, blocks, heads)
    for layer in range(kv.num_layers):
        in_place.add_layers(range(layer, layer + 1))
    gathered = RunningTensorChecksum()
    for run in kv.gathered_bytes(blocks, heads, range(kv.num_layers), 1 << 20):
        gathered.add(run)
    assert in_place.value == gathered.value


@pytest.mark.parametrize("run_words", [40, 4101])
def test_the_in_place_kernel_gives_the_gathers_value_after_bytes_ending_mid_row(run_words: int) -> None:
    """Both compiled variants (short and long runs), blocks that start 333 words before a row ends."""
    from dllm_connector.codec.device_checksum import ROW_WORDS, RunningTensorChecksum

    generator = torch.Generator().manual_seed(run_words)
    cache = torch.randint(-(2**62), 2**62, (64, 2, 3, run_words), generator=generator, dtype=torch.int64)
    cache = cache.to(CUDA)
    ids = torch.randperm(64, generator=generator)[:40].to(CUDA)
    prefix = torch.arange((ROW_WORDS - 333) * 8, dtype=torch.int64).to(torch.uint8).to(CUDA)
    in_place, gathered = RunningTensorChecksum(), RunningTensorChecksum()
    for running in (in_place, gathered):
        running.add(prefix)
    in_place.add_blocks(cache, ids)
    gathered.add(cache.index_select(0, ids).view(-1).view(torch.uint8))
    assert in_place.value == gathered.value
