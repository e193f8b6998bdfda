"""KV-cache codecs: none, fp8 (e4m3) and int8, with one scale per (block, KV head, K or V).

Pure tensor code (torch only, no I/O). A payload is the quantized data followed by its float32 scales,
described by a KVHeader (codec, source dtype, shape, scale groups, CRC-32 of the payload).

Input is a contiguous batch of KV blocks, shape [N, ...]; each block is split into `groups` equal,
contiguous scale groups (the caller lays a block out so that one group is one KV head's K or V).

Defined edge cases:
- an all-zero group gets the smallest normal float32 scale and decodes to exact zeros (no NaN);
- a group holding NaN or inf cannot be quantized: encode raises NonFiniteKVError (codec none carries
  NaN/inf bit-exact, so a caller may fall back to it);
- a KV cache that is already fp8 (--kv-cache-dtype fp8) passes through unchanged as codec none.

The quantize/dequantize kernels run fused through torch.compile where that works on this torch and
fall back to plain torch ops otherwise (DLLM_KV_CODEC_COMPILE=0 forces the fallback).
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dllm_connector.kvconfig import Compression

_log = logging.getLogger(__name__)

HEADER_VERSION = 1
SCALE_DTYPE = torch.float32
_SCALE_BYTES = 4
# The smallest normal float32: keeps 1/scale finite for all-zero and subnormal groups.
_MIN_SCALE = float(torch.finfo(torch.float32).tiny)
# Elements per kernel call: small enough for the float32 temporaries to stay in the CPU's L2.
_CHUNK_ELEMENTS = 1 << 20

QUANT_DTYPE: Mapping[Compression, torch.dtype] = {
    Compression.FP8: torch.float8_e4m3fn,
    Compression.INT8: torch.int8,
}
QMAX: Mapping[Compression, float] = {Compression.FP8: 448.0, Compression.INT8: 127.0}
SOURCE_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
# KV caches stored in one byte already (fp8 KV cache): never re-quantized.
_ONE_BYTE_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8})


class CodecError(ValueError):
    """A payload or header cannot be encoded or decoded; the message says why."""


class NonFiniteKVError(CodecError):
    """The KV holds NaN or inf, which a scaled 8-bit code cannot represent."""


class ChecksumError(CodecError):
    """The payload's CRC-32 differs from the header's: it was corrupted on the way."""


def _dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in SOURCE_DTYPES.items():
        if candidate == dtype:
            return name
    raise CodecError(f"unsupported KV dtype {dtype}; supported: {', '.join(SOURCE_DTYPES)}")


@dataclass(frozen=True)
class KVHeader:
    """What a receiver needs to size, verify and decode one payload."""

    codec: Compression
    dtype: str
    shape: tuple[int, ...]
    groups: int
    checksum: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return SOURCE_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def num_scales(self) -> int:
        return 0 if self.codec is Compression.NONE else self.shape[0] * self.groups

    @property
    def data_nbytes(self) -> int:
        if self.codec is Compression.NONE:
            return self.numel * self.torch_dtype.itemsize
        return self.numel

    @property
    def payload_nbytes(self) -> int:
        return self.data_nbytes + self.num_scales * _SCALE_BYTES

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the uncompressed KV this payload stands for."""
        return self.numel * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": HEADER_VERSION,
            "codec": self.codec.value,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "groups": self.groups,
            "checksum": self.checksum,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVHeader:
        try:
            if raw["v"] != HEADER_VERSION:
                raise CodecError(f"KV header version {raw['v']!r}, this connector reads {HEADER_VERSION}")
            header = cls(
                codec=Compression(raw["codec"]),
                dtype=str(raw["dtype"]),
                shape=tuple(int(size) for size in raw["shape"]),
                groups=int(raw["groups"]),
                checksum=int(raw["checksum"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, CodecError):
                raise
            raise CodecError(f"malformed KV header {dict(raw)!r}: {error}") from None
        _check_geometry(header.dtype, header.shape, header.groups)
        return header


def _check_geometry(dtype: str, shape: tuple[int, ...], groups: int) -> None:
    if dtype not in SOURCE_DTYPES:
        raise CodecError(f"unsupported KV dtype {dtype!r}; supported: {', '.join(SOURCE_DTYPES)}")
    if not shape or any(size <= 0 for size in shape):
        raise CodecError(f"KV shape {shape} must be [num_blocks, ...] with every size > 0")
    per_block = 1
    for size in shape[1:]:
        per_block *= size
    if groups <= 0 or per_block % groups:
        raise CodecError(f"{groups} scale groups do not divide a block of {per_block} elements")


def effective_codec(requested: Compression, dtype: torch.dtype) -> Compression:
    """The codec really used: a one-byte (fp8) KV cache always travels as it is."""
    return Compression.NONE if dtype in _ONE_BYTE_DTYPES else requested


def payload_nbytes(requested: Compression, dtype: torch.dtype, shape: tuple[int, ...], groups: int) -> int:
    """Payload size before encoding, to reserve staging space."""
    _check_geometry(_dtype_name(dtype), shape, groups)
    codec = effective_codec(requested, dtype)
    return KVHeader(codec, _dtype_name(dtype), shape, groups, 0).payload_nbytes


def checksum(payload: torch.Tensor) -> int:
    """CRC-32 of a contiguous byte tensor (zlib releases the GIL while it runs)."""
    return zlib.crc32(payload.numpy().data)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise CodecError("KV blocks must be contiguous; gather them first")
    return tensor.reshape(-1).view(torch.uint8)


# ---- kernels -------------------------------------------------------------------------------------


# Kernels return float32; the copy into the payload or the KV does the final cast, which measured
# faster on CPU than casting inside the compiled kernel.


def _quantize_eager(rows: torch.Tensor, qmax: float, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = torch.aminmax(rows, dim=1)
    amax = torch.maximum(high.float(), low.float().neg())
    scale = (amax / qmax).clamp_(min=_MIN_SCALE)
    # Out of place (bf16 x float32 promotes): .float() of a float32 KV would alias the caller's tensor.
    scaled = torch.mul(rows, scale.reciprocal().unsqueeze(1)).clamp_(-qmax, qmax)
    return (scaled.round_() if integer else scaled), scale


def _dequantize_eager(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float().mul_(scale.unsqueeze(1))


def _quantize_fused(rows: torch.Tensor, qmax: float, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = rows.abs().amax(dim=1).float()
    scale = (amax / qmax).clamp(min=_MIN_SCALE)
    scaled = (rows.float() * scale.reciprocal().unsqueeze(1)).clamp(-qmax, qmax)
    return (scaled.round() if integer else scaled), scale


def _dequantize_fp8_bits(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 -> float through float16 bit patterns, which vectorizes where the fp8 cast does not.

    e4m3's 7 magnitude bits placed at float16 bits 13..7 give the same value times 2^-8 (exponent
    bias 15 vs 7), subnormals included; the factor goes into the scale. Exact for every finite code;
    the two NaN codes, which encode never writes, would read as +-480.
    """
    bits = codes.view(torch.uint8).to(torch.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(torch.int16).view(torch.float16)
    return half.float() * (scale * 256.0).unsqueeze(1)


QuantizeFn = Callable[[torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]]
DequantizeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Kernels:
    quantize: QuantizeFn
    dequantize: DequantizeFn
    compiled: bool


_kernels: _Kernels | None = None


def _compile_kernels() -> _Kernels:
    """Fused kernels via torch.compile, verified on a tiny tensor; plain torch ops if that fails."""
    eager = _Kernels(_quantize_eager, _dequantize_eager, compiled=False)
    try:
        quantize: QuantizeFn = torch.compile(_quantize_fused, dynamic=True)
        dequantize: DequantizeFn = torch.compile(_dequantize_fp8_bits, dynamic=True)
        probe = torch.linspace(-2.0, 2.0, 64, dtype=torch.bfloat16).reshape(2, 32)
        codes, scale = quantize(probe, 448.0, False)
        restored = dequantize(codes.to(torch.float8_e4m3fn), scale)
        if not torch.allclose(restored, probe.float(), rtol=0.07, atol=1e-3):
            return eager
    except Exception as error:  # noqa: BLE001 - any compiler failure means the plain path
        _log.warning("torch.compile unavailable for the KV codec, using plain torch ops: %s", error)
        return eager
    return _Kernels(quantize, dequantize, compiled=True)


_kernels_lock = threading.Lock()


def kernels() -> _Kernels:
    with _kernels_lock:  # senders on several threads must not compile twice
        if _kernels is None:
            use_compiled(os.environ.get("DLLM_KV_CODEC_COMPILE", "1") != "0")
        assert _kernels is not None
        return _kernels


def warm_up(sample: torch.Tensor, requested: Compression, groups: int) -> None:
    """Compile (or load) the kernels now, e.g. at engine start, not on the first request's path.

    Compiling took 5-17 s on two cores; in a vLLM worker that first send stalled for as long.
    """
    codec = effective_codec(requested, sample.dtype)
    if codec is Compression.NONE:
        return
    header, payload = encode(sample.contiguous(), codec, groups)
    decode(header, payload)


def use_compiled(enabled: bool) -> bool:
    """Choose the kernels explicitly (tests, benchmarks); returns whether compiled ones are in use."""
    global _kernels
    _kernels = _compile_kernels() if enabled else _Kernels(_quantize_eager, _dequantize_eager, False)
    return _kernels.compiled


# ---- encode / decode -----------------------------------------------------------------------------


def _target(out: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() < nbytes:
        raise CodecError(f"output buffer must be a contiguous uint8 vector of at least {nbytes} bytes")
    return out[:nbytes]


def encode(
    blocks: torch.Tensor, requested: Compression, groups: int, out: torch.Tensor | None = None
) -> tuple[KVHeader, torch.Tensor]:
    """Encode a contiguous [N, ...] block batch; returns the header and the payload (a view of out)."""
    dtype = _dtype_name(blocks.dtype)
    shape = tuple(blocks.shape)
    _check_geometry(dtype, shape, groups)
    codec = effective_codec(requested, blocks.dtype)
    draft = KVHeader(codec, dtype, shape, groups, 0)
    payload = _target(out, draft.payload_nbytes)
    if codec is Compression.NONE:
        payload.copy_(as_bytes(blocks))
    else:
        _quantize_into(blocks, codec, groups, payload, draft.data_nbytes)
    return KVHeader(codec, dtype, shape, groups, checksum(payload)), payload


def _row_chunks(rows: int, row_len: int) -> range:
    """Chunk starts: about _CHUNK_ELEMENTS per chunk keeps the float32 temporaries in cache."""
    return range(0, rows, max(1, _CHUNK_ELEMENTS // row_len))


def _quantize_into(
    blocks: torch.Tensor, codec: Compression, groups: int, payload: torch.Tensor, data_nbytes: int
) -> None:
    rows = blocks.reshape(blocks.shape[0] * groups, -1)
    codes = payload[:data_nbytes].view(QUANT_DTYPE[codec]).view(rows.shape)
    scales = payload[data_nbytes:].view(SCALE_DTYPE)
    quantize = kernels().quantize
    qmax, integer = QMAX[codec], codec is Compression.INT8
    step = _row_chunks(*rows.shape).step
    for start in range(0, rows.shape[0], step):
        scaled, scale = quantize(rows[start : start + step], qmax, integer)
        codes[start : start + step].copy_(scaled)
        scales[start : start + step].copy_(scale)
    if not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise NonFiniteKVError(f"{bad} of {scales.numel()} scale groups hold NaN or inf; use codec none")


def verify(header: KVHeader, payload: torch.Tensor) -> torch.Tensor:
    """The payload trimmed to its size, after its length and CRC-32 matched the header."""
    if payload.numel() < header.payload_nbytes:
        raise CodecError(f"payload has {payload.numel()} bytes, header says {header.payload_nbytes}")
    payload = payload[: header.payload_nbytes]
    actual = checksum(payload)
    if actual != header.checksum:
        raise ChecksumError(f"KV payload checksum {actual:#010x} != header {header.checksum:#010x}")
    return payload


def decode(header: KVHeader, payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify and decode a payload into a [N, ...] tensor of the source dtype (written into out if given)."""
    payload = verify(header, payload)
    dtype = header.torch_dtype
    if out is None:
        out = torch.empty(header.shape, dtype=dtype)
    elif tuple(out.shape) != header.shape or out.dtype != dtype or not out.is_contiguous():
        raise CodecError(f"decode target must be contiguous {dtype} of shape {list(header.shape)}")
    if header.codec is Compression.NONE:
        as_bytes(out).copy_(payload)
        return out
    codes = payload[: header.data_nbytes].view(QUANT_DTYPE[header.codec])
    scale = payload[header.data_nbytes :].view(SCALE_DTYPE)
    rows = codes.reshape(header.num_scales, -1)
    target = out.view(header.num_scales, -1)
    # int8 -> float is vectorized in eager torch and beat the compiled kernel; fp8 gains from the
    # compiled bit-pattern kernel (the compiled path dequantizes fp8 only).
    dequantize = _dequantize_eager if header.codec is Compression.INT8 else kernels().dequantize
    step = _row_chunks(*rows.shape).step
    for start in range(0, rows.shape[0], step):
        chunk = dequantize(rows[start : start + step], scale[start : start + step])
        target[start : start + step].copy_(chunk)
    return out
