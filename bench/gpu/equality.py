"""The device kernels bit for bit against the host's C kernels: codes and scales, decoded values, nh64."""

from __future__ import annotations

from typing import Any

from gpu.kv import KV_HEADS, LAYERS, with_edge_groups
from gpu.passes import label


def equality_rows(kv: Any, device: Any, name: str) -> list[dict[str, Any]]:
    """Device kernels against the host's on one sample of the KV (the first two layers' worth)."""
    import torch

    from dllm_connector import codec
    from dllm_connector.codec import device_checksum
    from dllm_contract.kvconfig import Compression

    sample = with_edge_groups(kv[: max(4, kv.shape[0] * 2 // LAYERS)])
    host_sample, shape = sample.cpu(), tuple(sample.shape)
    reference = codec.use_kernels("native")  # the C kernels, where they build here
    expected = {}
    for compression in (Compression.FP8, Compression.INT8):
        header, payload = codec.encode(host_sample, compression, KV_HEADS)
        expected[compression] = (payload.clone(), codec.decode(header, payload))
    rows = []
    codec.use_kernels(name)
    used = label(kv.dtype, device)
    for compression in (Compression.FP8, Compression.INT8):
        out = torch.empty(
            codec.payload_nbytes(compression, kv.dtype, shape, KV_HEADS), dtype=torch.uint8, device=device
        )
        header, payload = codec.encode_parts(
            [sample], shape, kv.dtype, compression, KV_HEADS, out, checksum_algo=codec.ChecksumAlgo.NH64
        )
        values = codec.decode(header, payload)
        host_payload, host_values = expected[compression]
        on_host = payload.cpu()
        rows.append(
            {
                "kernels": used,
                "reference": reference,
                "codec": compression.value,
                "bytes": int(on_host.numel()),
                "payload_equal": bool(torch.equal(on_host, host_payload)),
                "decoded_equal": bool(
                    torch.equal(values.cpu().view(torch.uint8), host_values.view(torch.uint8))
                ),
                "checksum_equal": header.checksum == codec.checksum(header, on_host)
                and device_checksum.tensor_checksum(payload) == device_checksum.tensor_checksum(on_host),
            }
        )
    codec.use_kernels("native")
    return rows
