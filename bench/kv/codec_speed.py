"""The codec by itself: GB/s per core on the host, per kernel set, and quantizing on a GPU where there
is one."""

from __future__ import annotations

import statistics
import time
from typing import Any

from kv.shape import BLOCK, HEAD_DIM, KV_HEADS, LAYERS

# (kernel set, codec, encode GB/s, decode GB/s, encode median GB/s, decode median GB/s): the best run, the
# least disturbed by the rest of the machine, and the median beside it.
CodecFigures = list[tuple[str, str, float, float, float, float]]


def codec_per_core(tokens: int, repeats: int, kernels: str) -> CodecFigures:
    """(kernels, codec, encode and decode GB/s: best, then median) on one thread, for `tokens` of the
    KV; nothing where that kernel set is unavailable here. The worker's own kernels are in use again
    afterwards.

    As in the pipe, encode writes into a staging buffer and decode into a KV batch that were
    allocated (and touched) before, so page faults of fresh buffers are not counted.
    """
    import torch

    from dllm_connector import codec
    from dllm_contract.kvconfig import Compression

    torch.set_num_threads(1)
    own = codec.kernels().name
    if codec.use_kernels(kernels) != kernels:
        codec.use_kernels(own)
        return []
    blocks = -(-tokens // BLOCK)
    batch = torch.randn(LAYERS * blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
    staging = torch.zeros(batch.numel() * batch.element_size(), dtype=torch.uint8)
    target = torch.zeros_like(batch)
    groups = 2 * KV_HEADS
    results = []
    for name in ("fp8", "int8"):
        compression = Compression(name)
        header, payload = codec.encode(batch, compression, groups, out=staging)
        codec.decode(header, payload, target)
        encode = _timed(repeats, lambda c=compression: codec.encode(batch, c, groups, out=staging))
        decode = _timed(repeats, lambda h=header, p=payload: codec.decode(h, p, target))
        gbs = batch.numel() * batch.element_size() / 1e9
        best, median = (
            (gbs / min(encode), gbs / min(decode)),
            (gbs / statistics.median(encode), gbs / statistics.median(decode)),
        )
        results.append((kernels, name, *best, *median))
    codec.use_kernels(own)
    return results


def _timed(count: int, run: Any) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def gpu_codec() -> None:
    """fp8 and int8 quantize GB/s on the GPU, printed, where torch sees one."""
    import torch

    if not torch.cuda.is_available():
        return
    from dllm_connector import codec
    from dllm_contract.kvconfig import Compression

    batch = torch.randn(LAYERS * 128, KV_HEADS, BLOCK, 2 * HEAD_DIM, device="cuda").to(torch.bfloat16)
    rows = batch.reshape(-1, BLOCK * 2 * HEAD_DIM)
    codes = torch.empty(rows.shape, dtype=torch.uint8, device="cuda")

    scales = torch.empty(rows.shape[0], device="cuda")

    def quantize(name: str) -> None:
        functions = codec.kernels().by_codec[Compression(name)]
        functions.encode_into(rows, codes if name == "fp8" else codes.view(torch.int8), scales)
        torch.cuda.synchronize()

    for name in ("fp8", "int8"):
        quantize(name)
        seconds = min(_timed(5, lambda n=name: quantize(n)))
        print(f"  GPU {name} quantize: {batch.numel() * 2 / seconds / 1e9:.1f} GB/s")
