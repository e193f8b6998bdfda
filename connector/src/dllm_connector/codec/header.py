"""The wire header of a KV payload, its errors, dtype tables and checksum."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from dllm_connector.codec import device_checksum
from dllm_connector.codec.checksum import RunningChecksum, combine_checksums
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)


class ChecksumAlgo(StrEnum):
    """What a header's checksum is of: XXH3-64 read from host memory (what every peer before issue 20
    sends), or `device_checksum`'s torch ops, run where the payload is (a GPU's staging)."""

    XXH3_64 = "xxh3_64"
    NH64 = "nh64"


# 2: data and scales hashed apart; batches may come in pieces; the checksum is XXH3-64 (no
# "checksum_algo" key). 3: the same, the checksum's algorithm named by "checksum_algo". An XXH3
# header is still written as version 2, byte for byte as before, so an older peer reads it; one it
# cannot verify (nh64) is version 3, which an older peer refuses by its version before using a byte.
HEADER_VERSION = 3
_XXH3_ONLY_VERSION = 2
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
    checksum_algo: ChecksumAlgo = ChecksumAlgo.XXH3_64

    def same_layout(self, other: KVHeader) -> bool:
        """Whether the two describe the same payload bytes (codec, dtype, shape, groups), whatever
        their checksums and the checksums' algorithms."""
        return (self.codec, self.dtype, self.shape, self.groups) == (
            other.codec,
            other.dtype,
            other.shape,
            other.groups,
        )

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
        xxh3 = self.checksum_algo is ChecksumAlgo.XXH3_64
        raw: dict[str, Any] = {
            "v": _XXH3_ONLY_VERSION if xxh3 else HEADER_VERSION,
            "codec": self.codec.value,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "groups": self.groups,
            "checksum": self.checksum,
        }
        if not xxh3:
            raw["checksum_algo"] = self.checksum_algo.value
        return raw

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVHeader:
        """A peer's header, every field of its exact type (a number written as a string, a float or a
        bool is refused, not converted); CodecError, with at most a bounded excerpt of it, otherwise."""
        try:
            shape = raw["shape"]
            if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
                raise CodecError(f"KV header shape must be a list of at most {_MAX_DIMS} sizes")
            checksum = _exact_int(raw["checksum"], "checksum")
            if not 0 <= checksum < 1 << 64:
                raise CodecError("KV header checksum must be a 64-bit unsigned integer")
            dtype = raw["dtype"]
            if not isinstance(dtype, str):
                raise CodecError("KV header dtype must be a string")
            header = cls(
                codec=Compression(raw["codec"]),
                dtype=dtype,
                shape=tuple(_exact_int(size, "shape") for size in shape),
                groups=_exact_int(raw["groups"], "groups"),
                checksum=checksum,
                checksum_algo=_checksum_algo(raw),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, CodecError):
                raise
            raise CodecError(f"malformed KV header {repr(dict(raw))[:200]}: {str(error)[:100]}") from None
        check_geometry(header.dtype, header.shape, header.groups)
        return header


_MAX_DIMS = 8  # a payload's shape: [blocks, layers, K/V, ...]; far fewer in practice


def _exact_int(value: Any, field: str) -> int:
    """`value` if it is an int (not a bool, float or string), else CodecError naming the field."""
    if type(value) is not int:
        raise CodecError(f"KV header {field} must be an integer, not {type(value).__name__}")
    return value


def _checksum_algo(raw: Mapping[str, Any]) -> ChecksumAlgo:
    """The algorithm a header's version and "checksum_algo" name; refused unless known."""
    version = raw["v"]
    if version == _XXH3_ONLY_VERSION:
        if "checksum_algo" in raw:
            raise CodecError("a version 2 KV header names no checksum_algo (its checksum is XXH3-64)")
        return ChecksumAlgo.XXH3_64
    if version != HEADER_VERSION:
        shown = repr(version)[:40]
        raise CodecError(
            f"KV header version {shown}, this connector reads {_XXH3_ONLY_VERSION} and {HEADER_VERSION}"
        )
    if "checksum_algo" not in raw:
        raise CodecError(f"a version {HEADER_VERSION} KV header must name its checksum_algo")
    name = raw["checksum_algo"]
    known = {algo.value: algo for algo in ChecksumAlgo}
    if not isinstance(name, str) or name not in known:
        raise CodecError(
            f"KV header names checksum algorithm {repr(name)[:40]}; this connector knows {', '.join(known)}"
        )
    return known[name]


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
    """The payload's checksum by the header's algorithm: that of its data, and for codes that of its
    scales too, combined.

    Data and scales are hashed apart, each in order, so that a payload written part by part can
    hash each part's codes and scales as soon as they are final, whatever the parts are.
    """
    running = PayloadChecksum(header, payload)
    running.add(header.ranges(0, header.shape[0]))
    return running.value


def default_checksum_algo(payload: torch.Tensor) -> ChecksumAlgo:
    """XXH3-64 for a host payload (fast there, and what older peers verify), nh64 on a device."""
    return ChecksumAlgo.XXH3_64 if payload.device.type == "cpu" else ChecksumAlgo.NH64


class PayloadChecksum:
    """`checksum` fed range lists from `KVHeader.ranges` in entry order: each region hashed in order,
    by the header's algorithm (nh64: on the payload's device, one host sync for `value`)."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        self._payload, regions = payload, len(header.ranges(0, 0))
        self._host: list[RunningChecksum] = []
        self._device: list[device_checksum.RunningTensorChecksum] = []
        if header.checksum_algo is ChecksumAlgo.XXH3_64:
            if payload.device.type != "cpu":
                raise CodecError(
                    f"an XXH3-64 checksum reads host memory; a payload on {payload.device} takes nh64"
                )
            self._host = [RunningChecksum() for _ in range(regions)]
        else:
            self._device = [device_checksum.RunningTensorChecksum() for _ in range(regions)]

    def add(self, ranges: list[tuple[int, int]]) -> None:
        if self._host:
            base = self._payload.data_ptr()
            for host, (start, stop) in zip(self._host, ranges, strict=True):
                host.add(base + start, stop - start)
            return
        for device, (start, stop) in zip(self._device, ranges, strict=True):
            device.add(self._payload[start:stop])

    @property
    def value(self) -> int:
        if self._host:
            values = [region.value for region in self._host]
        else:
            values = device_checksum.values(self._device)
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
