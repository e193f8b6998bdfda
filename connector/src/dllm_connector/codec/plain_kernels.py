"""What a kernel set is (an encode and a decode per codec), and the reference set: plain torch ops.

Every other set (native C, torch.compile) is checked against this one at start, and falls back to it for
tensors it does not take.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from dllm_connector.codec.quant import (
    CodesFn,
    DecodeFn,
    ScalesFn,
    decoding_with,
    fp8_codes_cast,
    fp8_scales,
    fp8_values_cast,
    int8_codes,
    int8_decode_into,
    int8_scales,
)
from dllm_contract.kvconfig import Compression

EncodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class CodecKernels:
    encode_into: EncodeFn  # rows -> their codes and scales, written into the two outputs
    decode_into: DecodeFn


def encoding_with(scales: ScalesFn, codes: CodesFn) -> EncodeFn:
    def encode_into(rows: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        inverse, scale = scales(rows)
        codes(rows, inverse, codes_out)
        scales_out.copy_(scale)

    return encode_into


PLAIN: Mapping[Compression, CodecKernels] = {
    Compression.FP8: CodecKernels(encoding_with(fp8_scales, fp8_codes_cast), decoding_with(fp8_values_cast)),
    Compression.INT8: CodecKernels(encoding_with(int8_scales, int8_codes), int8_decode_into),
}
