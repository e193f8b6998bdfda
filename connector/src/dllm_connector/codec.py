"""KV-cache codecs: none, fp8 (e4m3) and int8, with one scale per (block, KV head, K or V).

Tensor code: the one I/O is choosing the kernels once (native_codec builds or loads the C library;
torch.compile compiles). A payload is the quantized data followed by its float32 scales,
described by a KVHeader (codec, source dtype, shape, scale groups, XXH3-64 checksum of the payload).

Input is a contiguous batch of KV blocks, shape [N, ...]; each block is split into `groups` equal,
contiguous scale groups (the caller lays a block out so that one group is one KV head's K or V).

Defined edge cases:
- an all-zero group gets the smallest normal float32 scale and decodes to exact zeros (no NaN);
- a group holding NaN or inf cannot be quantized: encode raises NonFiniteKVError (codec none carries
  NaN/inf bit-exact, so a caller may fall back to it);
- a KV cache that is already fp8 (--kv-cache-dtype fp8) passes through unchanged as codec none.

fp8 scales are powers of two (exact scaling, integer rounding to e4m3). Three sets of kernels write
the same payload bytes (tests compare them), chosen by DLLM_KV_CODEC_KERNELS:
- native (the default): C loops (native_codec, kvcodec.c) on host tensors, built for this CPU at first
  use, plain torch ops on other devices; where they cannot be built, compiled, else plain;
- compiled: fused by torch.compile (which also needs a C++ compiler);
- plain: torch ops, no compiler.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from dllm_connector import native_codec
from dllm_connector.checksum import RunningChecksum, combine_checksums
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)

HEADER_VERSION = 2  # 2: data and scales hashed apart; batches may come in pieces
SCALE_DTYPE = torch.float32
_SCALE_BYTES = 4
# The smallest normal float32: keeps 1/scale finite for all-zero and subnormal groups.
_MIN_SCALE = float(torch.finfo(torch.float32).tiny)

QUANT_DTYPE: Mapping[Compression, torch.dtype] = {
    Compression.FP8: torch.float8_e4m3fn,
    Compression.INT8: torch.int8,
}
QMAX: Mapping[Compression, float] = {Compression.FP8: 448.0, Compression.INT8: 127.0}
# How the kernels see the codes: e4m3 as its bit patterns.
_CODE_DTYPE: Mapping[Compression, torch.dtype] = {Compression.FP8: torch.uint8, Compression.INT8: torch.int8}
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
        return _product(self.shape)

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

    def ranges(self, first: int, count: int) -> list[tuple[int, int]]:
        """The payload byte ranges [start, stop) of first-axis entries [first, first + count): their
        data, and for codes their scales too (data and scales are two regions, entries in order)."""
        entry_nbytes = self.data_nbytes // self.shape[0]
        data = (first * entry_nbytes, (first + count) * entry_nbytes)
        if self.codec is Compression.NONE:
            return [data]
        scales_nbytes = self.groups * _SCALE_BYTES
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


def checksum(header: KVHeader, payload: torch.Tensor) -> int:
    """The payload's checksum: XXH3-64 of its data, and for codes that of its scales too, combined.

    Data and scales are hashed apart, each in order, so that a payload written part by part can
    hash each part's codes and scales as soon as they are final, whatever the parts are.
    """
    running = _PayloadChecksum(header, payload)
    running.add(header.ranges(0, header.shape[0]))
    return running.value


class _PayloadChecksum:
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


# ---- kernels -------------------------------------------------------------------------------------
#
# Each codec has two kernels on a chunk of rows (one row = one scale group): `encode_into` (rows ->
# 8-bit codes and one scale per row, written straight into the payload) and `decode_into` (codes ->
# values in the KV dtype, written into the target). The torch ones encode in two steps: `scales` (per
# row: the reciprocal used to encode, and the scale the payload carries), then `codes`. Compiled,
# torch.compile fuses each step into one loop (fp8's decode into two, over whole int32 words); plain
# torch ops use torch's fp8 casts instead of the integer ops, which unfused would cost a pass each.
# The C kernels (kvcodec.c) do each row's amax and codes in one call, the same arithmetic per element.
# All give the same bytes (tests check it).
#
# fp8 uses power-of-two scales 2^k, the smallest with amax * 2^-k <= 448. Multiplying by 2^-k is
# exact, and the float32 -> e4m3 rounding is then done with integer ops on the float32 bit pattern,
# which vectorizes where torch's scalar fp8 cast does not. A floating-point code loses almost nothing
# to a power-of-two scale: its relative error is set by its 3 mantissa bits; only the subnormal range
# moves up by at most one binade (see the error bound in docs/kv-connector.md).

_FLOAT32_EXP_MASK = 0x7F800000  # bits at or above: inf or NaN
_E4M3_MIN_NORMAL_BITS = 121 << 23  # float32 bits of 2^-6, the smallest normal e4m3
_E4M3_REBIAS = 120 << 3  # exponent bias 127 -> 7, in units of the code's exponent field
_SUBNORMAL_ROUNDER = 16384.0  # 2^14: its float32 ulp is 2^-9, e4m3's subnormal step
_SUBNORMAL_ROUNDER_BITS = 0x46800000


def _fp8_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: 2^-k and the scale 2^k, the smallest power of two with amax * 2^-k <= 448.

    amax = 1.f * 2^(e - 127) and 448 = 1.75 * 2^8, so k = e - 135, plus one where f > .75. k stays
    >= -126 (the smallest normal float32 scale, also that of an all-zero row). A row holding NaN or
    inf gets a NaN scale, which encode refuses.
    """
    bits = rows.abs().amax(dim=1).float().view(torch.int32)
    k = ((bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)).clamp(min=-126)
    inverse = ((127 - k) << 23).view(torch.float32)
    scale = ((127 + k) << 23).view(torch.float32)
    return inverse, torch.where(bits >= _FLOAT32_EXP_MASK, float("nan"), scale)


def _fp8_codes(rows: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    """e4m3 codes of rows * inverse, rounded to nearest even, written into out (uint8)."""
    x = rows.float()
    scaled = x.abs() * inverse.unsqueeze(1)  # exact (a power of two), at most 448
    bits = scaled.view(torch.int32)
    # Normal range: round the float32 mantissa to 3 bits (ties to even); a carry moves the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - _E4M3_REBIAS
    # Subnormal range (below 2^-6, steps of 2^-9): the float add rounds to the step.
    subnormal = (scaled + _SUBNORMAL_ROUNDER).view(torch.int32) - _SUBNORMAL_ROUNDER_BITS
    code = torch.where(bits < _E4M3_MIN_NORMAL_BITS, subnormal, normal).clamp(max=0x7E)
    code = code | ((x.view(torch.int32) >> 24) & 0x80)
    # int32 -> uint8 has no vector conversion on AVX2, float32 -> uint8 has: 2x faster through float.
    out.copy_(code.float().to(torch.uint8))


def _fp8_values(codes: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    """e4m3 codes times their row's scale, as float32: exact for every finite code.

    e4m3's 7 magnitude bits placed at float16 bits 13..7 give the same value times 2^-8 (exponent
    bias 15 vs 7), subnormals included; float16 -> float32 vectorizes where the fp8 cast does not.
    The two NaN codes, which encode never writes, read as +-480. A value beyond the KV dtype's range
    (a group at that range's top whose largest code rounded up) saturates at `limit`, never inf.
    """
    bits = codes.to(torch.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(torch.int16).view(torch.float16)
    # Times 2^8 first: exact, where scale * 2^8 could overflow for a scale near float32's top.
    return (half.float() * 256.0 * scale.unsqueeze(1)).clamp(-limit, limit)


def _fp8_half_words(words: torch.Tensor) -> torch.Tensor:
    """The float16 bits `_fp8_values` builds, four codes per int32 word: reading whole words avoids
    inductor's slow byte loads on AVX2. Returns [words, 2] int32 holding the float16 in code order."""
    even = words & 0x00FF00FF  # codes 0 and 2 of each word, one per 16-bit lane
    odd = (words >> 8) & 0x00FF00FF  # codes 1 and 3
    even = ((even & 0x00800080) << 8) | ((even & 0x007F007F) << 7)
    odd = ((odd & 0x00800080) << 8) | ((odd & 0x007F007F) << 7)
    low = (even & 0xFFFF) | (odd << 16)  # codes 0, 1
    high = ((even >> 16) & 0xFFFF) | (odd & -0x10000)  # codes 2, 3
    return torch.stack([low, high], dim=-1)


def _fp8_widen_into(half: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
    """float16 (from `_fp8_half_words`) times 2^8 and the row's scale, cast into out in the same pass."""
    out.copy_((half.float() * 256.0 * scale.unsqueeze(1)).clamp(-limit, limit))


def _fp8_decode_by_words(
    half_words: Callable[[torch.Tensor], torch.Tensor], widen_into: DecodeFn
) -> DecodeFn:
    """`_fp8_values` into out in two passes over whole int32 words (rows of a multiple of 4 codes)."""

    def decode_into(codes: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
        if codes.shape[-1] % 4 or not codes.is_contiguous() or codes.data_ptr() % 4:
            out.copy_(_fp8_values(codes, scale, limit))
            return
        half = half_words(codes.view(torch.int32)).view(torch.float16).view(codes.shape)
        widen_into(half, scale, limit, out)

    return decode_into


def _decoding_with(values: ValuesFn) -> DecodeFn:
    """A decode into out from a kernel that returns float32 (the copy casts to the KV dtype)."""

    def decode_into(codes: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
        out.copy_(values(codes, scale, limit))

    return decode_into


def _fp8_codes_cast(rows: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    """The same codes through torch's float32 -> e4m3 cast: one op, faster than the integer ops
    when they cannot be fused (plain torch ops)."""
    out.view(torch.float8_e4m3fn).copy_(torch.mul(rows, inverse.unsqueeze(1)))


def _fp8_values_cast(codes: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float().mul_(scale.unsqueeze(1)).clamp_(-limit, limit)


def _int8_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: 127 / amax and the scale amax / 127 (NaN or inf for a row holding them)."""
    scale = (rows.abs().amax(dim=1).float() / 127.0).clamp(min=_MIN_SCALE)
    return scale.reciprocal(), scale


def _int8_codes(rows: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_((rows.float() * inverse.unsqueeze(1)).clamp(-127.0, 127.0).round().to(torch.int8))


def _int8_values(codes: torch.Tensor, scale: torch.Tensor, limit: float) -> torch.Tensor:
    # Eager on purpose: int8 -> float is vectorized in eager torch and beat a compiled kernel.
    return codes.float().mul_(scale.unsqueeze(1))


ScalesFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
CodesFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
ValuesFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor], None]


EncodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class _CodecKernels:
    encode_into: EncodeFn  # rows -> their codes and scales, written into the two outputs
    decode_into: DecodeFn


def _encoding_with(scales: ScalesFn, codes: CodesFn) -> EncodeFn:
    def encode_into(rows: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor) -> None:
        inverse, scale = scales(rows)
        codes(rows, inverse, codes_out)
        scales_out.copy_(scale)

    return encode_into


@dataclass
class _Kernels:
    by_codec: Mapping[Compression, _CodecKernels]
    name: str  # native, compiled or plain
    # Rows per kernel call, in elements: compiled calls cost about 45 us each, so they take large
    # chunks; plain torch ops make float32 temporaries, so their chunks stay small.
    chunk_elements: int


_PLAIN: Mapping[Compression, _CodecKernels] = {
    Compression.FP8: _CodecKernels(
        _encoding_with(_fp8_scales, _fp8_codes_cast), _decoding_with(_fp8_values_cast)
    ),
    Compression.INT8: _CodecKernels(_encoding_with(_int8_scales, _int8_codes), _decoding_with(_int8_values)),
}
_PLAIN_CHUNK_ELEMENTS = 1 << 18
_COMPILED_CHUNK_ELEMENTS = 1 << 22
_NATIVE_CHUNK_ELEMENTS = 1 << 22  # no temporaries: chunks only bound one call
# Decode's temporaries per chunk (fp8: float16 bits; int8: float32 values) stay in cache at these sizes.
_DECODE_CHUNK_ELEMENTS: Mapping[Compression, int] = {Compression.FP8: 1 << 21, Compression.INT8: 1 << 20}

_kernels: _Kernels | None = None


def _unviewed(arg: Any) -> Any:
    """A view as a tensor over the same memory that is no view (anything else as it is): torch.compile
    guards on a view's base too, and a one-row base (a one-block batch) compiled a kernel again on a
    request's path."""
    if not isinstance(arg, torch.Tensor) or not arg._is_view():
        return arg
    alias = torch.empty(0, dtype=arg.dtype, device=arg.device)
    return alias.set_(arg.untyped_storage(), arg.storage_offset(), arg.shape, arg.stride())


_F = TypeVar("_F", bound=Callable[..., Any])


def _compile(function: _F) -> _F:
    """torch.compile with dynamic sizes, fed views as plain tensors: it then compiles twice at most
    per dtype, for one row and for more (sizes 0 and 1 are always specialized), both at warm-up."""
    compiled = torch.compile(function, dynamic=True)

    @functools.wraps(function)
    def call(*args: Any) -> Any:
        return compiled(*map(_unviewed, args))

    return cast(_F, call)


def _compiled_kernels() -> Mapping[Compression, _CodecKernels]:
    return {
        Compression.FP8: _CodecKernels(
            _encoding_with(_compile(_fp8_scales), _compile(_fp8_codes)),
            # two compiled passes over words beat one over bytes
            _fp8_decode_by_words(_compile(_fp8_half_words), _compile(_fp8_widen_into)),
        ),
        Compression.INT8: _CodecKernels(
            _encoding_with(_compile(_int8_scales), _compile(_int8_codes)),
            _decoding_with(_int8_values),  # eager on purpose (see _int8_values)
        ),
    }


# The dtype numbers of kvcodec.c.
_NATIVE_DTYPES: Mapping[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _native_takes(
    codec: Compression, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> bool:
    """Whether the C kernels take these as they are: host tensors, contiguous, plain (no lazy negation
    or conjugate), values of a dtype they know, codes of the same shape and one float32 scale per row;
    anything else goes to the torch ops."""
    tensors = (values, codes, scales)
    return (
        values.dtype in _NATIVE_DTYPES
        and values.dim() == 2
        and codes.shape == values.shape
        and codes.dtype == _CODE_DTYPE[codec]
        and scales.dtype == SCALE_DTYPE
        and scales.numel() == values.shape[0]
        and all(
            t.device.type == "cpu" and t.is_contiguous() and not (t.is_neg() or t.is_conj()) for t in tensors
        )
    )


# A call of the C kernels runs over torch's intra-op threads, as torch's own ops would (the calling
# thread takes the first slice of rows), in slices of at least this many elements: smaller ones cost
# more to hand out than to run.
_MIN_ELEMENTS_PER_THREAD = 1 << 18
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _row_slices(nrows: int, length: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges, one per thread that gets work."""
    threads = max(1, min(torch.get_num_threads(), nrows * length // _MIN_ELEMENTS_PER_THREAD, nrows))
    step = -(-nrows // threads)
    return [(start, min(start + step, nrows)) for start in range(0, nrows, step)]


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="kv-codec")
        return _pool


def _over_rows(run: Callable[[int, int], None], nrows: int, length: int) -> None:
    """run(start, stop) for every slice of rows, the slices on threads of their own but the first."""
    first, *others = _row_slices(nrows, length)
    pending = [_thread_pool().submit(run, start, stop) for start, stop in others]
    try:
        run(*first)
    finally:
        for future in pending:
            future.result()


def _native_kernels(library: native_codec.NativeCodec) -> Mapping[Compression, _CodecKernels]:
    """The C kernels where they take the tensors, plain torch ops elsewhere (e.g. on a GPU)."""

    def for_codec(codec: Compression) -> _CodecKernels:
        fp8, plain = codec is Compression.FP8, _PLAIN[codec]

        def encode_into(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
            if not _native_takes(codec, rows, codes, scales):
                plain.encode_into(rows, codes, scales)
                return
            dtype, (nrows, length), item = _NATIVE_DTYPES[rows.dtype], rows.shape, rows.element_size()
            values, out, scale = rows.data_ptr(), codes.data_ptr(), scales.data_ptr()

            def run(start: int, stop: int) -> None:
                at = start * length
                library.encode(
                    fp8,
                    dtype,
                    values + at * item,
                    stop - start,
                    length,
                    out + at,
                    scale + _SCALE_BYTES * start,
                )

            _over_rows(run, nrows, length)

        def decode_into(codes: torch.Tensor, scale: torch.Tensor, limit: float, out: torch.Tensor) -> None:
            if not _native_takes(codec, out, codes, scale):
                plain.decode_into(codes, scale, limit, out)
                return
            dtype, (nrows, length), item = _NATIVE_DTYPES[out.dtype], out.shape, out.element_size()
            source, scales, target = codes.data_ptr(), scale.data_ptr(), out.data_ptr()

            def run(start: int, stop: int) -> None:
                at = start * length
                library.decode(
                    fp8,
                    dtype,
                    source + at,
                    scales + _SCALE_BYTES * start,
                    stop - start,
                    length,
                    limit,
                    target + at * item,
                )

            _over_rows(run, nrows, length)

        return _CodecKernels(encode_into, decode_into)

    return {codec: for_codec(codec) for codec in _PLAIN}


_PLAIN_KERNELS = _Kernels(_PLAIN, "plain", _PLAIN_CHUNK_ELEMENTS)


def _probe_rows(dtype: torch.dtype) -> torch.Tensor:
    """A few groups of each kind encode treats apart: ordinary values, zeros, subnormals, the dtype's
    largest finite values and exact powers of two."""
    info = torch.finfo(dtype)
    groups = [
        torch.linspace(-2.0, 2.0, 64),
        torch.zeros(32),
        torch.full((32,), info.tiny) * torch.linspace(-1.0, 1.0, 32),
        torch.full((32,), info.max) * torch.linspace(-1.0, 1.0, 32),
        2.0 ** torch.arange(-16, 16).float(),
    ]
    return torch.cat(groups).to(dtype).reshape(-1, 32)


def _checked(candidate: _Kernels, dtypes: Iterable[torch.dtype]) -> _Kernels | None:
    """`candidate` if it writes what the plain kernels write on probes of `dtypes`; else None (with a
    warning)."""
    for dtype in dtypes:
        rows = _probe_rows(dtype)
        for codec in _PLAIN:
            if not all(
                _same_round_trip(some, codec, _PLAIN_KERNELS, candidate) for some in _row_shapes(rows)
            ):
                _log.warning(
                    "%s %s KV codec differs from plain torch ops on %s", candidate.name, codec, dtype
                )
                return None
    return candidate


def _native_set() -> _Kernels | None:
    library = native_codec.load()
    if library is None:
        return None
    return _checked(_Kernels(_native_kernels(library), "native", _NATIVE_CHUNK_ELEMENTS), _NATIVE_DTYPES)


def _compiled_set() -> _Kernels | None:
    try:
        # bf16 only: each dtype probed is a compile (seconds each) at engine start
        return _checked(_Kernels(_compiled_kernels(), "compiled", _COMPILED_CHUNK_ELEMENTS), [torch.bfloat16])
    except Exception as error:  # noqa: BLE001 - any compiler failure means the next set
        _log.warning("torch.compile is unavailable for the KV codec: %s", error)
        return None


def _choose_kernels(name: str) -> _Kernels:
    """The named kernel set, checked against the plain one; where it is unavailable, the next of
    native -> compiled -> plain (each step says why in a warning)."""
    order = {"native": (_native_set, _compiled_set), "compiled": (_compiled_set,), "plain": ()}
    if name not in order:
        _log.warning("DLLM_KV_CODEC_KERNELS=%s is none of native, compiled, plain; using native", name)
        name = "native"
    for make in order[name]:
        chosen = make()
        if chosen is not None:
            return chosen
    return _PLAIN_KERNELS


def _row_shapes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row, and all of them (at least two): the two sizes torch.compile tells apart (see
    `_compile`)."""
    return rows[:1], rows if rows.shape[0] >= 2 else rows[:1].repeat(2, 1)


def _round_trip_rows(
    rows: torch.Tensor, functions: _CodecKernels, code_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and decoded values of [rows, group] values, through both kernels."""
    codes = torch.empty(rows.shape, dtype=code_dtype)  # on the host, as staging is
    scale = torch.empty(rows.shape[0], dtype=SCALE_DTYPE)
    functions.encode_into(rows, codes, scale)
    restored = torch.empty(rows.shape, dtype=rows.dtype)  # decode runs on the host, as the pipe's does
    functions.decode_into(codes, scale, float(torch.finfo(rows.dtype).max), restored)
    return codes, scale, restored


def _same_round_trip(probe: torch.Tensor, codec: Compression, plain: _Kernels, other: _Kernels) -> bool:
    """Byte for byte (torch.equal would call NaNs unequal and -0.0 equal to 0.0)."""
    expected, got = (_round_trip_rows(probe, k.by_codec[codec], _CODE_DTYPE[codec]) for k in (plain, other))
    return all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(expected, got, strict=True))


_kernels_lock = threading.Lock()


def kernels() -> _Kernels:
    with _kernels_lock:  # senders on several threads must not compile twice
        if _kernels is None:
            use_kernels(os.environ.get("DLLM_KV_CODEC_KERNELS", "native"))
        assert _kernels is not None
        return _kernels


def warm_up(sample: torch.Tensor, requested: Compression, groups: int) -> None:
    """Compile (or load) the kernels for the KV dtype now, e.g. at engine start, not on a request's path.

    Compiling took 5-17 s on two cores; in a vLLM worker a send stalled for as long, past the
    receiver's timeout. Both row counts torch.compile tells apart are compiled here.
    """
    codec = effective_codec(requested, sample.dtype)
    if codec is Compression.NONE:
        return
    rows = sample.contiguous().reshape(sample.shape[0] * groups, -1)
    functions = kernels().by_codec[codec]
    for some in _row_shapes(rows):
        _round_trip_rows(some, functions, _CODE_DTYPE[codec])


def use_kernels(name: str) -> str:
    """Choose the kernels explicitly (tests, benchmarks): native, compiled or plain; returns the name
    of the set in use (the next available one where the one asked for is not)."""
    global _kernels
    _kernels = _choose_kernels(name)
    return _kernels.name


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
    return encode_parts([blocks], tuple(blocks.shape), blocks.dtype, requested, groups, out)


def encode_parts(
    parts: Iterable[torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requested: Compression,
    groups: int,
    out: torch.Tensor | None = None,
    on_part: Callable[[list[tuple[int, int]]], None] | None = None,
) -> tuple[KVHeader, torch.Tensor]:
    """Encode a batch of `shape` handed over in consecutive parts along its first axis.

    A part may be overwritten once the next is taken (e.g. one layer at a time in a reused buffer),
    so each is encoded, and hashed, while still in cache, with no batch-sized copy in between.
    `on_part(ranges)` is told the payload byte ranges each part filled (its data, and its scales),
    final (hashed, never written again), so they can go on the wire while the next part encodes.
    """
    name = _dtype_name(dtype)
    _check_geometry(name, shape, groups)
    codec = effective_codec(requested, dtype)
    draft = KVHeader(codec, name, shape, groups, 0)
    payload = _target(out, draft.payload_nbytes)
    writer = _PartWriter(draft, payload)
    for part in parts:
        filled = writer.write(part)
        if on_part is not None:
            on_part(filled)
    return KVHeader(codec, name, shape, groups, writer.finish()), payload


class _PayloadViews:
    """A payload seen as its parts: raw bytes per first-axis entry (none), or code rows and scales."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        self._header, self._payload = header, payload
        if header.codec is not Compression.NONE:
            codes = payload[: header.data_nbytes].view(_CODE_DTYPE[header.codec])
            self._codes = codes.view(header.num_scales, -1)
            self._scales = payload[header.data_nbytes :].view(SCALE_DTYPE)


class _PartWriter(_PayloadViews):
    """Encodes consecutive parts of a batch into their places in one payload."""

    def __init__(self, header: KVHeader, payload: torch.Tensor) -> None:
        super().__init__(header, payload)
        self._done = 0  # first-axis entries written so far
        self._checksum = _PayloadChecksum(header, payload)

    def write(self, part: torch.Tensor) -> list[tuple[int, int]]:
        """Encode the next part into its place; returns the payload byte ranges it filled."""
        header = self._header
        if (
            part.dim() != len(header.shape)
            or part.shape[1:] != header.shape[1:]
            or part.dtype != header.torch_dtype
        ):
            raise CodecError(f"part {list(part.shape)} {part.dtype} does not fit batch {list(header.shape)}")
        count = part.shape[0]
        if not part.is_contiguous():
            raise CodecError("KV blocks must be contiguous; gather them first")
        if self._done + count > header.shape[0]:
            raise CodecError(f"parts hold more than the batch's {header.shape[0]} entries")
        filled = header.ranges(self._done, count)
        if header.codec is Compression.NONE:
            start, stop = filled[0]
            target, source = self._payload[start:stop], as_bytes(part)
            if source.data_ptr() != target.data_ptr():  # a part gathered in place needs no copy
                target.copy_(source)
        else:
            first, last = self._done * header.groups, (self._done + count) * header.groups
            rows = part.reshape(count * header.groups, -1)
            _quantize_rows(rows, header.codec, self._codes[first:last], self._scales[first:last])
        self._checksum.add(filled)
        self._done += count
        return filled

    def finish(self) -> int:
        """Check that every entry came and every scale is finite; returns the payload's checksum."""
        header = self._header
        if self._done != header.shape[0]:
            raise CodecError(f"parts held {self._done} of the batch's {header.shape[0]} entries")
        if header.codec is not Compression.NONE and not bool(torch.isfinite(self._scales).all()):
            bad = int((~torch.isfinite(self._scales)).sum())
            raise NonFiniteKVError(
                f"{bad} of {self._scales.numel()} scale groups hold NaN or inf; use codec none"
            )
        return self._checksum.value


def _product(sizes: Iterable[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _row_chunks(rows: int, row_len: int, chunk_elements: int) -> range:
    """Chunk starts: whole rows, about chunk_elements per kernel call."""
    return range(0, rows, max(1, chunk_elements // row_len))


def _quantize_rows(rows: torch.Tensor, codec: Compression, codes: torch.Tensor, scales: torch.Tensor) -> None:
    chosen = kernels()
    functions = chosen.by_codec[codec]
    chunks = _row_chunks(rows.shape[0], rows.shape[1], chosen.chunk_elements)
    for start in chunks:
        stop = start + chunks.step
        functions.encode_into(rows[start:stop], codes[start:stop], scales[start:stop])


def verify(header: KVHeader, payload: torch.Tensor) -> torch.Tensor:
    """The payload trimmed to its size, after its length and checksum matched the header."""
    payload = _trimmed(header, payload)
    _check_checksum(checksum(header, payload), header.checksum)
    return payload


def _trimmed(header: KVHeader, payload: torch.Tensor) -> torch.Tensor:
    if payload.numel() < header.payload_nbytes:
        raise CodecError(f"payload has {payload.numel()} bytes, header says {header.payload_nbytes}")
    return payload[: header.payload_nbytes]


def _check_checksum(actual: int, expected: int) -> None:
    if actual != expected:
        raise ChecksumError(f"KV payload checksum {actual:#018x} != header {expected:#018x}")


def _part_entries(header: KVHeader, parts: int) -> int:
    """First-axis entries per part, where the batch splits into `parts` equal parts."""
    if parts <= 0 or header.shape[0] % parts:
        raise CodecError(f"a batch of {header.shape[0]} entries does not split into {parts} parts")
    return header.shape[0] // parts


def decode(header: KVHeader, payload: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify and decode a payload into a [N, ...] tensor of the source dtype (written into out if given)."""
    dtype = header.torch_dtype
    if out is None:
        out = torch.empty(header.shape, dtype=dtype)
    elif tuple(out.shape) != header.shape or out.dtype != dtype or not out.is_contiguous():
        raise CodecError(f"decode target must be contiguous {dtype} of shape {list(header.shape)}")
    _PartReader(header, verify(header, payload)).read_into(0, out)
    return out


def decode_parts(header: KVHeader, payload: torch.Tensor, parts: int) -> Iterator[torch.Tensor]:
    """Verify a payload, then decode it in `parts` equal consecutive parts along the first axis.

    Every part is written into the same buffer, valid until the next one is taken: a consumer that
    places each part right away (e.g. one layer into its KV blocks) finds it still in cache.
    """
    count = _part_entries(header, parts)
    reader = _PartReader(header, verify(header, payload))
    part = torch.empty((count, *header.shape[1:]), dtype=header.torch_dtype)
    for index in range(parts):
        reader.read_into(index * count, part)
        yield part


class StreamingDecode:
    """Decodes a payload part by part as its parts arrive, and verifies it once all have.

    For a payload written in pieces: part k can be decoded once its data and scales are in,
    before the rest of the payload is, so decode overlaps the wire. Each part's data and scales
    are hashed just before it is decoded (then read from cache), each region in order, as
    `checksum` hashes them. Decoded parts are not verified until `verify`: a consumer that places
    them must treat the places as failed if it raises.
    """

    def __init__(self, header: KVHeader, payload: torch.Tensor, parts: int) -> None:
        self._header, self._parts = header, parts
        self._count = _part_entries(header, parts)
        payload = _trimmed(header, payload)
        self._reader = _PartReader(header, payload)
        self._part = torch.empty((self._count, *header.shape[1:]), dtype=header.torch_dtype)
        self._checksum = _PayloadChecksum(header, payload)
        self.decoded = 0  # parts decoded so far

    def parts_until(self, stop: int) -> Iterator[torch.Tensor]:
        """Decode parts up to `stop` (exclusive), each into one reused buffer, in order."""
        if not self.decoded <= stop <= self._parts:
            raise CodecError(f"parts {self.decoded}..{stop} are not the next of {self._parts}")
        while self.decoded < stop:
            first = self.decoded * self._count
            self._checksum.add(self._header.ranges(first, self._count))
            self._reader.read_into(first, self._part)
            self.decoded += 1
            yield self._part

    def verify(self, expected: int) -> None:
        """After every part: the payload's checksum must be `expected` (the sender's)."""
        if self.decoded != self._parts:
            raise CodecError(f"verified after {self.decoded} of {self._parts} parts")
        _check_checksum(self._checksum.value, expected)


class _PartReader(_PayloadViews):
    """Decodes any run of a verified payload's first-axis entries into a tensor."""

    def read_into(self, first: int, out: torch.Tensor) -> None:
        header, count = self._header, out.shape[0]
        if header.codec is Compression.NONE:
            start, stop = header.ranges(first, count)[0]
            as_bytes(out).copy_(self._payload[start:stop])
            return
        rows = slice(first * header.groups, (first + count) * header.groups)
        target = out.view(count * header.groups, -1)
        decode_into = kernels().by_codec[header.codec].decode_into
        limit = float(torch.finfo(header.torch_dtype).max)
        codes, scales = self._codes[rows], self._scales[rows]
        # L3: scales come from the peer; a NaN, inf or non-positive one would be decoded into the cache
        if not bool(((scales > 0) & torch.isfinite(scales)).all()):
            raise CodecError("received KV scales are not all finite and positive")
        chunks = _row_chunks(target.shape[0], target.shape[1], _DECODE_CHUNK_ELEMENTS[header.codec])
        for start in chunks:
            stop = start + chunks.step
            decode_into(codes[start:stop], scales[start:stop], limit, target[start:stop])
