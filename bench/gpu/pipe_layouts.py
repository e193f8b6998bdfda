"""The pipe end to end on one device (gpu-review item 17): a prefill side and a decode side in this
process, each with its own Mooncake engine over TCP, moving each cache layout vLLM hands over on a GPU
(FlashAttention's NHD, head-major HND, MLA's latent) on each data path, with each codec.

On CUDA the device path needs Mooncake's CUDA build and DLLM_KV_TCP_DEVICE=1 (set here): two engines on
one GPU have no RDMA NIC between them. On the CPU both paths run as the operator's override runs them,
the same code with CPU tensors. Each row says which path and mode the pipe took, whether decode's blocks
hold what prefill's held (codec none: byte for byte; fp8/int8: within the codec's bound), and how fast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from gpu.kv import BLOCK, HEAD_DIM, KV_HEADS

HOST = "127.0.0.1"
MLA_WIDTH = 576  # DeepSeek-V2/V3's kv_lora_rank 512 + rope 64
RELATIVE_ERROR = {"none": 0.0, "fp8": 0.04, "int8": 0.01}  # randn KV, a scale per head or latent block
TIMEOUT_S = 120.0


def _layouts(device: Any, layers: int, blocks: int) -> dict[str, Callable[[bool], tuple[Any, Any]]]:
    """Per layout: a function giving (caches, geometry), random (prefill) or zeroed (decode)."""
    import torch

    from dllm_connector.layout import Geometry

    def filled(shape: tuple[int, ...], random: bool) -> Any:
        if not random:
            return torch.zeros(shape, dtype=torch.bfloat16, device=device)
        return torch.randn(shape, device=device).to(torch.bfloat16)

    heads = Geometry(block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, model="gpu-check")
    latent = Geometry(
        block_size=BLOCK, num_kv_heads=1, head_dim=MLA_WIDTH, model="gpu-check-mla", total_kv_heads=1
    )

    def nhd(random: bool) -> tuple[Any, Any]:
        shape = (2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
        return {f"layers.{n}": filled(shape, random) for n in range(layers)}, heads

    def hnd(random: bool) -> tuple[Any, Any]:
        shape = (2, blocks, KV_HEADS, BLOCK, HEAD_DIM)  # in memory; handed over as a permuted view
        return {f"layers.{n}": filled(shape, random).permute(0, 1, 3, 2, 4) for n in range(layers)}, heads

    def mla(random: bool) -> tuple[Any, Any]:
        shape = (blocks, BLOCK, MLA_WIDTH)
        return {f"layers.{n}": filled(shape, random) for n in range(layers)}, latent

    return {"nhd": nhd, "hnd": hnd, "mla": mla}


def pipe_rows(device: Any, tokens: int, layers: int) -> list[dict[str, Any]]:
    """A row per (layout, data path, codec), or one row saying why none ran."""
    if device.type == "cuda":
        os.environ["DLLM_KV_TCP_DEVICE"] = "1"  # read when each transport starts
    try:
        from dllm_connector.transport.mooncake import MooncakeTransport

        decode_transport, prefill_transport = MooncakeTransport(HOST), MooncakeTransport(HOST)
    except Exception as error:  # noqa: BLE001 - reported as the row
        return [{"skipped": f"Mooncake does not start: {type(error).__name__}: {error}"}]
    blocks = 2 * -(-tokens // BLOCK) + 8
    rows = []
    try:
        for layout, make in _layouts(device, layers, blocks).items():
            for path in ("device", "pinned-host"):
                for codec_name in ("none", "fp8", "int8"):
                    rows.append(
                        {"layout": layout, "path": path, "codec": codec_name}
                        | _move(make, path, codec_name, tokens, blocks, (decode_transport, prefill_transport))
                    )
    finally:
        prefill_transport.close()
        decode_transport.close()
    return rows


def _move(
    make: Callable[[bool], tuple[Any, Any]],
    path: str,
    codec_name: str,
    tokens: int,
    blocks: int,
    transports: tuple[Any, Any],
) -> dict[str, Any]:
    import torch

    from dllm_connector.layout import PagedKV
    from dllm_connector.pipe.common import PipeConfig, gb
    from dllm_connector.pipe.receiver import KVReceiver
    from dllm_connector.pipe.sender import KVSender, SendJob
    from dllm_connector.transport.placement import PathSetting
    from dllm_contract.kvconfig import Compression

    count = -(-tokens // BLOCK)
    torch.manual_seed(count)  # the caches' values
    generator = torch.Generator().manual_seed(count)
    src = [int(b) for b in torch.randperm(blocks, generator=generator)[:count]]
    dst = [int(b) for b in torch.randperm(blocks, generator=generator)[:count]]
    source_caches, geometry = make(True)
    target_caches, _ = make(False)
    source, target = PagedKV(source_caches, blocks, geometry), PagedKV(target_caches, blocks, geometry)
    config = PipeConfig(data_path=PathSetting(path)).with_extra(
        compression=Compression(codec_name),
        buffer_size_gb=gb(max(64 << 20, 2 * source.batch_nbytes(count))),
        transfer_timeout_ms=int(TIMEOUT_S * 1000),
        prefill_wait_ms=int(TIMEOUT_S * 1000),
        hold_seconds=int(TIMEOUT_S),
    )
    decode_transport, prefill_transport = transports
    try:
        receiver = KVReceiver(decode_transport, target, config, HOST, 0)
    except Exception as error:  # noqa: BLE001 - a path this machine cannot take is a row, not a crash
        return {"skipped": f"{type(error).__name__}: {error}"}
    sender = KVSender(prefill_transport, source, config)
    transfer = f"{codec_name}-{path}-{id(source)}"
    try:
        receiver.expect(transfer, dst)
        started = time.perf_counter()
        sender.submit(SendJob(transfer, tuple(src), HOST, receiver.port))
        outcome = receiver.wait_for(transfer, TIMEOUT_S)
        elapsed = time.perf_counter() - started
        sent_reason = sender.finished().get(transfer)
        want, got = source.gather(src).float(), target.gather(dst).float()
        relative = float((got - want).norm() / want.norm())
        return {
            "taken": receiver.placement.describe().split(":")[0],
            "decode": outcome or "loaded",
            "prefill": sent_reason or "sent",
            "relative_error": relative,
            "ok": outcome == "" and sent_reason is None and relative <= RELATIVE_ERROR[codec_name],
            "kv_bytes": source.batch_nbytes(count),
            "gbps": source.batch_nbytes(count) / elapsed / 1e9,
        }
    finally:
        sender.close(timeout=10)
        receiver.close()


def pipe_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["   layout path         codec  taken                          ok     error     GB/s"]
    for row in rows:
        if "skipped" in row:
            lines.append(
                f"   {row.get('layout', '')} {row.get('path', '')} {row.get('codec', '')}: {row['skipped']}"
            )
            continue
        lines.append(
            f"   {row['layout']:6s} {row['path']:12s} {row['codec']:5s}  {row['taken']:30s} {row['ok']!s:6s} "
            f"{row['relative_error']:.2e}  {row['gbps']:.2f}"
            + ("" if row["ok"] else f"  decode: {row['decode']}; prefill: {row['prefill']}")
        )
    return lines
