"""The codec's encode and decode GB/s on the device, per layer and whole, checksum included."""

from __future__ import annotations

import time
from typing import Any

from gpu.kv import KV_HEADS, LAYERS
from gpu.passes import label
from gpu.timing import count_syncs, gbps, seconds


def codec_rows(kv: Any, device: Any, name: str, repeats: int) -> list[dict[str, Any]]:
    from dllm_connector import codec
    from dllm_contract.kvconfig import Compression

    started = time.perf_counter()
    codec.use_kernels(name)
    used = label(kv.dtype, device)
    setup_s = round(time.perf_counter() - started, 2)
    rows = [
        codec_row(kv, device, compression, repeats) | {"kernels": used, "kernel_setup_s": setup_s}
        for compression in (Compression.FP8, Compression.INT8)
    ]
    codec.use_kernels("native")
    return rows


def codec_row(kv: Any, device: Any, compression: Any, repeats: int) -> dict[str, Any]:
    """One codec with the kernels in use: encode and decode per layer (as the pipe calls them) and
    whole, the nh64 checksum included in both."""
    import torch

    from dllm_connector import codec

    shape, raw = tuple(kv.shape), kv.numel() * kv.element_size()
    nbytes = codec.payload_nbytes(compression, kv.dtype, shape, KV_HEADS)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(kv)

    def encode(parts: Any) -> Any:
        return codec.encode_parts(
            parts, shape, kv.dtype, compression, KV_HEADS, out, checksum_algo=codec.ChecksumAlgo.NH64
        )

    started = time.perf_counter()
    header, payload = encode(kv.chunk(LAYERS))
    first_call_s = time.perf_counter() - started

    def decode_layers() -> None:
        stream = codec.StreamingDecode(header, payload, LAYERS)
        for index, part in enumerate(stream.parts_until(LAYERS)):
            target[index * part.shape[0] : (index + 1) * part.shape[0]].copy_(part)
        stream.verify(header.checksum, header.checksum_algo)

    from dllm_connector.codec import device_checksum

    checksum_kernel = "eager" if device_checksum.kernel(device) is device_checksum.terms_sum else "compiled"
    return {
        "codec": compression.value,
        "checksum_kernel": checksum_kernel,  # nh64's, chosen by default ("auto")
        "first_call_s": round(first_call_s, 2),  # compiles for this device, if any
        "encode_layers_gbps": gbps(raw, seconds(lambda: encode(kv.chunk(LAYERS)), device, repeats)),
        "encode_whole_gbps": gbps(raw, seconds(lambda: encode([kv]), device, repeats)),
        "decode_layers_gbps": gbps(raw, seconds(decode_layers, device, repeats)),
        "decode_whole_gbps": gbps(
            raw, seconds(lambda: codec.decode(header, payload, target), device, repeats)
        ),
        "encode_syncs": count_syncs(lambda: encode(kv.chunk(LAYERS)), device),
        "decode_syncs": count_syncs(decode_layers, device),
    }
