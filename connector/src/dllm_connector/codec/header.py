"""The wire header of a KV payload, its errors, dtype tables and checksum."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dllm_connector.checksum import RunningChecksum, combine_checksums
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)

HEADER_VERSION = 2  # 2: data and scales hashed apart; batches may come in pieces
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
# The smallest normal float32: keeps 1/scale finite for all-zero and subnormal groups.
MIN_SCALE = float(torch.finfo(torch.float32).tiny)

QUANT_DTYPE: Mapping[Compression, torch.dtype] = {
    Compression.FP8: torch.float8_e4m3fn,
    Compression.INT8: torch.int8,
}
QMAX: Mapping[Compression, float] = {Compression.FP8: 448.0, Compression.INT8: 127.0}
# How the kernels see the codes: e4m3 as its bit patterns.
CODE_DTYPE: Mapping[Compression, torch.dtype] = {Compression.FP8: torch.uint8, Compression.INT8: torch.int8}
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
    """The payload's checksum differs from the header's: it was corrupted on the way."""


def dtype_name(dtype: torch.dtype) -> str:
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
        return product(self.shape)

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
        return self.data_nbytes + self.num_scales * SCALE_BYTES

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the uncompressed KV this payload stands for."""
        return self.numel * self.torch_dtype.itemsize

    def ranges(self, first: int, count: int) -> list[tuple[int, int]]:
        """The payload byte ranges [start, stop) of first-axis entries [first, first + count): their
        data, and for codes their scales too (data and scales are two regions, entries in order)."""
        entry_nbytes = self.data_nbytes // self.shape[0]
        data = (first * entry_nbytes, (first + count) * entry_nbytes)
        if self.codec is Compression.NONE:
            return [data]
        scales_nbytes = self.groups * SCALE_BYTES
        return [
            data,
            (self.data_nbytes + first * scales_nbytes, self.data_nbytes + (first + count) * scales_nbytes),
        ]

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
        check_geometry(header.dtype, header.shape, header.groups)
        return header


def check_geometry(dtype: str, shape: tuple[int, ...], groups: int) -> None:
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
    check_geometry(dtype_name(dtype), shape, groups)
    codec = effective_codec(requested, dtype)
    return KVHeader(codec, dtype_name(dtype), shape, groups, 0).payload_nbytes


def checksum(header: KVHeader, payload: torch.Tensor) -> int:
    """The payload's checksum: XXH3-64 of its data, and for codes that of its scales too, combined.

    Data and scales are hashed apart, each in order, so that a payload written part by part can
    hash each part's codes and scales as soon as they are final, whatever the parts are.
    """
    running = PayloadChecksum(header, payload)
    running.add(header.ranges(0, header.shape[0]))
    return running.value


class PayloadChecksum:
    """`checksum` fed range lists from `KVHeader.ranges` in entry order: each region hashed in order."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        self._base = payload.data_ptr()
        self._regions = [RunningChecksum() for _ in header.ranges(0, 0)]

    def add(self, ranges: list[tuple[int, int]]) -> None:
        for region, (start, stop) in zip(self._regions, ranges, strict=True):
            region.add(self._base + start, stop - start)

    @property
    def value(self) -> int:
        values = [region.value for region in self._regions]
        return values[0] if len(values) == 1 else combine_checksums(*values)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise CodecError("KV blocks must be contiguous; gather them first")
    return tensor.reshape(-1).view(torch.uint8)


def product(sizes: Iterable[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count
