"""The kernel sets (native C, torch.compile, plain torch), their checks and the choice among them."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from dllm_connector.codec import device_checksum, native
from dllm_connector.codec.header import (
    CODE_DTYPE,
    SCALE_BYTES,
    SCALE_DTYPE,
    CodecError,
    as_bytes,
    effective_codec,
)
from dllm_connector.codec.quant import (
    CodesFn,
    DecodeFn,
    ScalesFn,
    decoding_with,
    fp8_codes,
    fp8_codes_cast,
    fp8_decode_by_words,
    fp8_half_words,
    fp8_scales,
    fp8_values_cast,
    fp8_widen_into,
    int8_codes,
    int8_decode_into,
    int8_scales,
)
from dllm_connector.tuning import EngineTuning
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)

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
    # Rows per kernel call, in elements: each compiled call has a fixed cost (docs/kv-connector.md,
    # Codec), so they take large chunks; plain torch ops make float32 temporaries, so their chunks
    # stay small.
    chunk_elements: int


_PLAIN: Mapping[Compression, _CodecKernels] = {
    Compression.FP8: _CodecKernels(
        _encoding_with(fp8_scales, fp8_codes_cast), decoding_with(fp8_values_cast)
    ),
    Compression.INT8: _CodecKernels(_encoding_with(int8_scales, int8_codes), int8_decode_into),
}
_PLAIN_CHUNK_ELEMENTS = 1 << 18
_COMPILED_CHUNK_ELEMENTS = 1 << 22
_NATIVE_CHUNK_ELEMENTS = 1 << 22  # no temporaries: chunks only bound one call
# Decode's temporaries per chunk (fp8: float16 bits; int8: float32 values) stay in cache at these sizes.
DECODE_CHUNK_ELEMENTS: Mapping[Compression, int] = {Compression.FP8: 1 << 21, Compression.INT8: 1 << 20}


@dataclass(frozen=True)
class KernelRequest:
    """The set the first use chooses (native, compiled or plain) and where native's library comes
    from: ready-made at `library`, else built into `cache` (codec.native). The engine sets it at start
    from its tuning variables (dllm_connector.tuning)."""

    name: str = "native"
    library: Path | None = None
    cache: Path | None = None

    @classmethod
    def of(cls, tuning: EngineTuning) -> KernelRequest:
        return cls(tuning.codec_kernels.value, tuning.codec_library, tuning.codec_cache)


_request = KernelRequest()
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
            _encoding_with(_compile(fp8_scales), _compile(fp8_codes)),
            # two compiled passes over words beat one over bytes
            fp8_decode_by_words(_compile(fp8_half_words), _compile(fp8_widen_into)),
        ),
        Compression.INT8: _CodecKernels(
            _encoding_with(_compile(int8_scales), _compile(int8_codes)),
            int8_decode_into,  # eager on purpose (see its docstring)
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
        and codes.dtype == CODE_DTYPE[codec]
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


def native_kernels(library: native.NativeCodec) -> Mapping[Compression, _CodecKernels]:
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
                    scale + SCALE_BYTES * start,
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
                    scales + SCALE_BYTES * start,
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


def _native_set(request: KernelRequest) -> _Kernels | None:
    library = native.load(library=request.library, cache=request.cache)
    if library is None:
        return None
    return _checked(_Kernels(native_kernels(library), "native", _NATIVE_CHUNK_ELEMENTS), _NATIVE_DTYPES)


def _compiled_set() -> _Kernels | None:
    try:
        # bf16 only: each dtype probed is a compile (seconds each) at engine start
        return _checked(_Kernels(_compiled_kernels(), "compiled", _COMPILED_CHUNK_ELEMENTS), [torch.bfloat16])
    except Exception as error:  # noqa: BLE001 - any compiler failure means the next set
        _log.warning("torch.compile is unavailable for the KV codec: %s", error)
        return None


def _choose_kernels(request: KernelRequest) -> _Kernels:
    """The requested kernel set, checked against the plain one; where it is unavailable, the next of
    native -> compiled -> plain (each step says why in a warning)."""
    native_set = functools.partial(_native_set, request)
    order = {"native": (native_set, _compiled_set), "compiled": (_compiled_set,), "plain": ()}
    name = request.name
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
    rows: torch.Tensor, functions: _CodecKernels, code_dtype: torch.dtype, staging: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and decoded values of [rows, group] values, through both kernels, with the
    payload and the decoded values where staging is (the host unless told)."""
    codes = torch.empty(rows.shape, dtype=code_dtype, device=staging)
    scale = torch.empty(rows.shape[0], dtype=SCALE_DTYPE, device=staging)
    functions.encode_into(rows, codes, scale)
    restored = torch.empty(rows.shape, dtype=rows.dtype, device=staging)
    functions.decode_into(codes, scale, float(torch.finfo(rows.dtype).max), restored)
    return codes, scale, restored


def _same_round_trip(probe: torch.Tensor, codec: Compression, plain: _Kernels, other: _Kernels) -> bool:
    """Byte for byte (torch.equal would call NaNs unequal and -0.0 equal to 0.0)."""
    expected, got = (_round_trip_rows(probe, k.by_codec[codec], CODE_DTYPE[codec]) for k in (plain, other))
    return all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(expected, got, strict=True))


_kernels_lock = threading.Lock()


def kernels() -> _Kernels:
    global _kernels
    with _kernels_lock:  # senders on several threads must not compile twice
        if _kernels is None:
            _kernels = _choose_kernels(_request)
        return _kernels


def configure(request: KernelRequest) -> None:
    """What the next first use chooses; a set chosen for another request is dropped."""
    global _request, _kernels
    with _kernels_lock:
        if request != _request:
            _request, _kernels = request, None


def warm_up(
    sample: torch.Tensor, requested: Compression, groups: int, *, staging: torch.device | None = None
) -> None:
    """Compile (or load) the kernels for the KV dtype now, e.g. at engine start, not on a request's path.

    Compiling took 5-17 s on two cores; in a vLLM worker a send stalled for as long, past the
    receiver's timeout. Both row counts torch.compile tells apart are compiled here.

    `staging`: where payloads will be (the host unless told). On a device (the device path), the
    kernels are compiled for payloads there, so is the nh64 checksum, and the kernels are checked
    there against the plain torch ops on the host on probe rows, bit for bit: a difference raises
    CodecError (one format on the wire: such a device should stage on the host).
    """
    codec = effective_codec(requested, sample.dtype)
    if staging is not None and staging.type != "cpu":
        device_checksum.kernel(staging)
    if codec is Compression.NONE:
        return
    rows = sample.contiguous().reshape(sample.shape[0] * groups, -1)
    functions = kernels().by_codec[codec]
    for some in _row_shapes(rows):
        _round_trip_rows(some, functions, CODE_DTYPE[codec], staging)
    if staging is not None:
        _check_on(staging, codec, sample.dtype, functions)


def _check_on(
    staging: torch.device, codec: Compression, dtype: torch.dtype, functions: _CodecKernels
) -> None:
    for probe in _row_shapes(_probe_rows(dtype)):
        expected = _round_trip_rows(probe, _PLAIN[codec], CODE_DTYPE[codec])
        got = _round_trip_rows(probe.to(staging), functions, CODE_DTYPE[codec], staging)
        if not all(torch.equal(as_bytes(a), as_bytes(b.cpu())) for a, b in zip(expected, got, strict=True)):
            raise CodecError(
                f"the {kernels().name} {codec} KV kernels on {staging} write other bytes than the host's "
                f"for {dtype}; stage this KV on the host"
            )


def use_kernels(name: str) -> str:
    """Choose the kernels explicitly (tests, benchmarks): native, compiled or plain; returns the name
    of the set in use (the next available one where the one asked for is not)."""
    global _request, _kernels
    _request = replace(_request, name=name)
    _kernels = _choose_kernels(_request)
    return _kernels.name
