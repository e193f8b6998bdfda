"""KV-cache codecs: none, fp8 (e4m3) and int8, with one scale per (block, KV head, K or V).

Tensor code: the one I/O is choosing the kernels once (`native` builds or loads the C library;
torch.compile compiles). A payload is the quantized data followed by its float32 scales,
described by a KVHeader (codec, source dtype, shape, scale groups, checksum of the payload and its
algorithm: XXH3-64 on the host, `device_checksum`'s nh64 where the payload is on a device).

Input is a contiguous batch of KV blocks, shape [N, ...]; each block is split into `groups` equal,
contiguous scale groups (the caller lays a block out so that one group is one KV head's K or V).

Defined edge cases:
- an all-zero group gets the smallest normal float32 scale and decodes to exact zeros (no NaN);
- a group holding NaN or inf cannot be quantized: encode raises NonFiniteKVError (codec none carries
  NaN/inf bit-exact, so a caller may fall back to it);
- a KV cache that is already fp8 (--kv-cache-dtype fp8) passes through unchanged as codec none.

fp8 scales are powers of two (exact scaling, integer rounding to e4m3). Three sets of kernels write
the same payload bytes (tests compare them), chosen by DLLM_KV_CODEC_KERNELS (dllm_connector.tuning;
the engine passes it to `configure` at start):
- native (the default): C loops (`native`, kvcodec.c) on host tensors, built for this CPU at first
  use; where they cannot be built, compiled, else plain. Payloads on a device take the compiled set
  there (`device_kernels`: Triton on a GPU), checked there against the host's bytes, else plain;
- compiled: fused by torch.compile (which also needs a C++ compiler);
- plain: torch ops, no compiler.

The package, one idea per module: `header` (the wire header, errors, dtype tables, checksum), `quant`
(the fp8/int8 maths in torch), `plain_kernels` (what a kernel set is; the plain torch one),
`native_kernels` (the C kernels as a set, split by rows over threads), `kernel_sets` (the compiled set,
the checks and the choice among them), `stream` (encode and decode, whole or in parts), `checksum`
(XXH3-64 over host memory), `device_checksum` (nh64 in torch ops, where the payload is),
`block_checksum` (nh64 of KV blocks read in place by a Triton kernel taking block ids), and `native`
(the C kernels' build and load: stdlib only, so that the images build the library with it in a stage
without torch). Callers use the names below.
"""

from dllm_connector.codec.header import (
    HEADER_VERSION,
    QMAX,
    QUANT_DTYPE,
    SCALE_DTYPE,
    SOURCE_DTYPES,
    ChecksumAlgo,
    ChecksumError,
    CodecError,
    KVHeader,
    NonFiniteKVError,
    as_bytes,
    checksum,
    default_checksum_algo,
    effective_codec,
    payload_nbytes,
)
from dllm_connector.codec.kernel_sets import (
    KernelRequest,
    configure,
    device_kernels,
    kernels,
    use_kernels,
    warm_up,
)
from dllm_connector.codec.quant import DecodeFn
from dllm_connector.codec.stream import StreamingDecode, decode, decode_parts, encode, encode_parts, verify

__all__ = [
    "HEADER_VERSION",
    "QMAX",
    "QUANT_DTYPE",
    "SCALE_DTYPE",
    "SOURCE_DTYPES",
    "ChecksumAlgo",
    "ChecksumError",
    "CodecError",
    "DecodeFn",
    "KVHeader",
    "KernelRequest",
    "NonFiniteKVError",
    "StreamingDecode",
    "as_bytes",
    "checksum",
    "configure",
    "decode",
    "decode_parts",
    "default_checksum_algo",
    "device_kernels",
    "effective_codec",
    "encode",
    "encode_parts",
    "kernels",
    "payload_nbytes",
    "use_kernels",
    "verify",
    "warm_up",
]
