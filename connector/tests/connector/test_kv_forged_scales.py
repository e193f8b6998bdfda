"""Forged quantisation scales are never decoded into the cache (security review L3): a forger can
compute the checksum, so a NaN, infinite, zero or negative scale, or an int8 scale past what the
cache's dtype can hold, is refused by the codec itself.

The real codec on CPU tensors; no peer is needed to forge a payload.
"""

from __future__ import annotations

import pytest
import torch

from dllm_connector import codec
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def test_received_scales_that_are_not_finite_are_refused() -> None:
    """A forger can compute the checksum: a NaN or inf scale is still never decoded into the cache."""
    values = torch.randn(2, 4, 16, 64).to(torch.bfloat16)
    for codec_used in (Compression.FP8, Compression.INT8):
        header, payload = codec.encode(values, codec_used, groups=4)
        for bad in (float("nan"), float("inf"), 0.0, -1.0):
            forged = payload.clone()
            scales = forged[header.data_nbytes :].view(torch.float32)
            scales[1] = bad
            forged_header = codec.KVHeader(
                header.codec, header.dtype, header.shape, header.groups, codec.checksum(header, forged)
            )
            with pytest.raises(codec.CodecError, match="scales are not all finite, positive"):
                list(codec.decode_parts(forged_header, forged, 2))


def test_an_int8_scale_past_the_cache_dtype_is_refused_not_decoded_to_inf() -> None:
    """127 x a finite forged scale can exceed fp16's range (inf in the cache): int8 scales are bounded by
    what encode can give, the dtype's largest value / 127, and the largest honest one still decodes."""
    values = torch.randn(2, 4, 16, 64).to(torch.float16)
    header, payload = codec.encode(values, Compression.INT8, groups=4)
    largest = float(torch.tensor(torch.finfo(torch.float16).max, dtype=torch.float32) / 127.0)
    for scale, refused in ((1e4, True), (largest * 1.001, True), (largest, False)):
        forged = payload.clone()
        forged[header.data_nbytes :].view(torch.float32)[1] = scale
        forged_header = codec.KVHeader(
            header.codec, header.dtype, header.shape, header.groups, codec.checksum(header, forged)
        )
        if refused:
            with pytest.raises(codec.CodecError, match="within the KV dtype's range"):
                list(codec.decode_parts(forged_header, forged, 2))
        else:
            parts = list(codec.decode_parts(forged_header, forged, 2))
            assert all(bool(torch.isfinite(part).all()) for part in parts)
