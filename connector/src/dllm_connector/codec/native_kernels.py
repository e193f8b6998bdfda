"""The C kernels (codec/kvcodec.c) as a kernel set: each call split by rows over torch's intra-op
threads, and the plain torch ops for any tensor the C code does not take (e.g. on a GPU)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from dllm_connector.codec import native
from dllm_connector.codec.header import CODE_DTYPE, SCALE_BYTES, SCALE_DTYPE
from dllm_connector.codec.plain_kernels import PLAIN, CodecKernels
from dllm_contract.kvconfig import Compression

# The dtype numbers of kvcodec.c.
NATIVE_DTYPES: Mapping[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _native_takes(
    codec: Compression, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> bool:
    """Whether the C kernels take these as they are: host tensors, contiguous, plain (no lazy negation
    or conjugate), values of a dtype they know, codes of the same shape and one float32 scale per row;
    anything else goes to the torch ops."""
    tensors = (values, codes, scales)
    return (
        values.dtype in NATIVE_DTYPES
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


def native_kernels(library: native.NativeCodec) -> Mapping[Compression, CodecKernels]:
    """The C kernels where they take the tensors, plain torch ops elsewhere (e.g. on a GPU)."""

    def for_codec(codec: Compression) -> CodecKernels:
        fp8, plain = codec is Compression.FP8, PLAIN[codec]

        def encode_into(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
            if not _native_takes(codec, rows, codes, scales):
                plain.encode_into(rows, codes, scales)
                return
            dtype, (nrows, length), item = NATIVE_DTYPES[rows.dtype], rows.shape, rows.element_size()
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
            dtype, (nrows, length), item = NATIVE_DTYPES[out.dtype], out.shape, out.element_size()
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

        return CodecKernels(encode_into, decode_into)

    return {codec: for_codec(codec) for codec in PLAIN}
