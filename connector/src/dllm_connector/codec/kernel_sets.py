"""The kernel sets (native C, torch.compile, plain torch), their checks and the choice among them."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch

from dllm_connector.codec import device_checksum, native
from dllm_connector.codec.header import CODE_DTYPE, SCALE_DTYPE, CodecError, as_bytes, effective_codec
from dllm_connector.codec.native_kernels import NATIVE_DTYPES, native_kernels
from dllm_connector.codec.plain_kernels import PLAIN, CodecKernels, encoding_with
from dllm_connector.codec.quant import (
    fp8_codes,
    fp8_decode_by_words,
    fp8_half_words,
    fp8_scales,
    fp8_widen_into,
    int8_codes,
    int8_decode_into,
    int8_scales,
)
from dllm_connector.codec.views import unviewed
from dllm_contract.kvconfig import Compression

_log = logging.getLogger(__name__)


@dataclass
class _Kernels:
    by_codec: Mapping[Compression, CodecKernels]
    name: str  # native, compiled or plain
    # Rows per kernel call, in elements: each compiled call has a fixed cost (docs/kv-connector.md,
    # Codec), so they take large chunks; plain torch ops make float32 temporaries, so their chunks
    # stay small.
    chunk_elements: int


_PLAIN_CHUNK_ELEMENTS = 1 << 18
_COMPILED_CHUNK_ELEMENTS = 1 << 22
_NATIVE_CHUNK_ELEMENTS = 1 << 22  # no temporaries: chunks only bound one call
# Decode's temporaries per chunk (fp8: float16 bits; int8: float32 values) stay in cache at these sizes.
DECODE_CHUNK_ELEMENTS: Mapping[Compression, int] = {Compression.FP8: 1 << 21, Compression.INT8: 1 << 20}


class KernelTuning(Protocol):
    """What the engine's tuning model (dllm_connector.tuning) says of the kernels: read, not imported,
    so that the codec knows nothing of the engine's settings."""

    @property
    def codec_kernels(self) -> str: ...
    @property
    def codec_library(self) -> Path | None: ...
    @property
    def codec_cache(self) -> Path | None: ...


@dataclass(frozen=True)
class KernelRequest:
    """The set the first use chooses (native, compiled or plain) and where native's library comes
    from: ready-made at `library`, else built into `cache` (codec.native). The engine sets it at start
    from its tuning variables (dllm_connector.tuning)."""

    name: str = "native"
    library: Path | None = None
    cache: Path | None = None

    @classmethod
    def of(cls, tuning: KernelTuning) -> KernelRequest:
        return cls(str(tuning.codec_kernels), tuning.codec_library, tuning.codec_cache)


_request = KernelRequest()
_kernels: _Kernels | None = None


_F = TypeVar("_F", bound=Callable[..., Any])


def _compile(function: _F) -> _F:
    """torch.compile with dynamic sizes, fed views as plain tensors: it then compiles twice at most
    per dtype, for one row and for more (sizes 0 and 1 are always specialized), both at warm-up."""
    compiled = torch.compile(function, dynamic=True)

    @functools.wraps(function)
    def call(*args: Any) -> Any:
        return compiled(*map(unviewed, args))

    return cast(_F, call)


def _compiled_kernels() -> Mapping[Compression, CodecKernels]:
    return {
        Compression.FP8: CodecKernels(
            encoding_with(_compile(fp8_scales), _compile(fp8_codes)),
            # two compiled passes over words beat one over bytes
            fp8_decode_by_words(_compile(fp8_half_words), _compile(fp8_widen_into)),
        ),
        Compression.INT8: CodecKernels(
            encoding_with(_compile(int8_scales), _compile(int8_codes)),
            int8_decode_into,  # eager on purpose (see its docstring)
        ),
    }


_PLAIN_KERNELS = _Kernels(PLAIN, "plain", _PLAIN_CHUNK_ELEMENTS)


def _probe_rows(dtype: torch.dtype) -> torch.Tensor:
    """A few groups of each kind encode treats apart: ordinary values, zeros, subnormals, the dtype's
    largest finite values and exact powers of two; and a group whose largest value is each 8-bit
    mantissa (128..255 / 128, every bf16 one), where a division rounded another way than the host's
    shows in some scale (gpu-review item 1)."""
    info = torch.finfo(dtype)
    ramp = torch.linspace(-1.0, 1.0, 32)
    groups = [
        torch.linspace(-2.0, 2.0, 64),
        torch.zeros(32),
        torch.full((32,), info.tiny) * ramp,
        torch.full((32,), info.max) * ramp,
        2.0 ** torch.arange(-16, 16).float(),
        (torch.arange(128, 256).float() / 128).unsqueeze(1).mul(ramp).reshape(-1),
    ]
    return torch.cat(groups).to(dtype).reshape(-1, 32)


def _checked(candidate: _Kernels, dtypes: Iterable[torch.dtype]) -> _Kernels | None:
    """`candidate` if it writes what the plain kernels write on probes of `dtypes`; else None (with a
    warning)."""
    for dtype in dtypes:
        rows = _probe_rows(dtype)
        for codec in PLAIN:
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
    return _checked(_Kernels(native_kernels(library), "native", _NATIVE_CHUNK_ELEMENTS), NATIVE_DTYPES)


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
    rows: torch.Tensor, functions: CodecKernels, code_dtype: torch.dtype, staging: torch.device | None = None
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
_device_kernels: dict[tuple[str, torch.dtype], _Kernels] = {}  # by device type and KV dtype, off the host


def kernels() -> _Kernels:
    global _kernels
    with _kernels_lock:  # senders on several threads must not compile twice
        if _kernels is None:
            _kernels = _choose_kernels(_request)
        return _kernels


def device_kernels(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> _Kernels:
    """The set for payloads of `dtype` KV on `device`: the host's (`kernels()`) on the CPU. On another
    device, chosen at its first use there (the engine's warm-up): torch.compile's, Triton on a GPU,
    where each call is a fused pass or two instead of plain ops' twenty launches with float32
    temporaries (gpu-review item 14); plain ops where the compiled set does not build there or
    writes other bytes than the host's plain ops (a division rounded otherwise), or where `plain`
    was asked for (DLLM_KV_CODEC_KERNELS)."""
    if device.type == "cpu":
        return kernels()
    with _kernels_lock:
        chosen = _device_kernels.get((device.type, dtype))
        if chosen is None:
            chosen = _device_kernels[device.type, dtype] = _device_set(device, dtype, _request.name)
        return chosen


def _device_set(device: torch.device, dtype: torch.dtype, requested: str) -> _Kernels:
    if requested == "plain":
        return _PLAIN_KERNELS
    try:
        compiled = _Kernels(_compiled_kernels(), "compiled", _COMPILED_CHUNK_ELEMENTS)
        return same_on_device_or_plain(compiled, device, dtype)
    except Exception as error:  # noqa: BLE001 - any compiler failure means plain ops
        _log.warning("torch.compile is unavailable for the KV codec on %s: %s; plain ops", device, error)
        return _PLAIN_KERNELS


def same_on_device_or_plain(candidate: _Kernels, device: torch.device, dtype: torch.dtype) -> _Kernels:
    """`candidate` if, on `device`, it writes the host's plain ops' bytes for probes of `dtype`;
    else the plain set (with a warning), which warm-up checks there in turn."""
    for codec in PLAIN:
        if not _writes_host_bytes(device, codec, dtype, candidate.by_codec[codec]):
            _log.warning(
                "%s %s KV kernels on %s write other bytes than the host's for %s; plain ops",
                candidate.name,
                codec,
                device,
                dtype,
            )
            return _PLAIN_KERNELS
    return candidate


def configure(request: KernelRequest) -> None:
    """What the next first use chooses; a set chosen for another request is dropped."""
    global _request, _kernels
    with _kernels_lock:
        if request != _request:
            _request, _kernels = request, None
            _device_kernels.clear()


def warm_up(
    sample: torch.Tensor, requested: Compression, groups: int, *, staging: torch.device | None = None
) -> None:
    """Compile (or load) the kernels for the KV dtype now, e.g. at engine start, not on a request's path.

    Compiling takes seconds (docs/kv-connector.md); on a request's path a send stalled for as long, past
    the receiver's timeout. Both row counts torch.compile tells apart are compiled here.

    `staging`: where payloads will be (the host unless told). On a device (the device path), the
    kernels are compiled for payloads there, so is the nh64 checksum, and the kernels are checked
    there against the plain torch ops on the host on probe rows, bit for bit: a difference raises
    CodecError (one format on the wire: such a device should stage on the host).
    """
    codec = effective_codec(requested, sample.dtype)
    if staging is not None and staging.type != "cpu":
        device_checksum.kernel(staging)
        device_checksum.blocks_in_place(staging)  # the zero-copy checksum's kernel, built and probed
    if codec is Compression.NONE:
        return
    rows = sample.contiguous().reshape(sample.shape[0] * groups, -1)
    chosen = kernels() if staging is None else device_kernels(staging, sample.dtype)
    functions = chosen.by_codec[codec]
    for some in _row_shapes(rows):
        _round_trip_rows(some, functions, CODE_DTYPE[codec], staging)
    if staging is not None and not _writes_host_bytes(staging, codec, sample.dtype, functions):
        raise CodecError(
            f"the {chosen.name} {codec} KV kernels on {staging} write other bytes than the host's "
            f"for {sample.dtype}; stage this KV on the host"
        )


def _writes_host_bytes(
    device: torch.device, codec: Compression, dtype: torch.dtype, functions: CodecKernels
) -> bool:
    """Whether `functions` on `device` write the host's plain ops' codes, scales and decoded values
    for probes of `dtype`, bit for bit."""
    for probe in _row_shapes(_probe_rows(dtype)):
        expected = _round_trip_rows(probe, PLAIN[codec], CODE_DTYPE[codec])
        got = _round_trip_rows(probe.to(device), functions, CODE_DTYPE[codec], device)
        if not all(torch.equal(as_bytes(a), as_bytes(b.cpu())) for a, b in zip(expected, got, strict=True)):
            return False
    return True


def use_kernels(name: str) -> str:
    """Choose the kernels explicitly (tests, benchmarks): native, compiled or plain; returns the name
    of the set in use (the next available one where the one asked for is not)."""
    global _request, _kernels
    _request = replace(_request, name=name)
    _kernels = _choose_kernels(_request)
    _device_kernels.clear()
    return _kernels.name
