"""Where each KV block lives in a worker's paged caches, derived from the tensors' shapes and strides.

vLLM registers one tensor per attention layer. Its block axis is 0 (CPU: [blocks, kv_heads,
block_size, 2 * head_dim]; GPU: [blocks, 2, ...]) or 1 (GPU: [2, blocks, ...], K and V apart).
Everything inside one block at one K/V index ("a segment") must be contiguous; the layout refuses
tensors where it is not, rather than guess. The codec's scale groups split a segment into equal,
contiguous parts: one per (KV head, K or V) when the layout allows it.

Where prefill and decode run different TP sizes, `plan_tp_mapping` (pure) says which model KV heads
each prefill rank sends each decode rank, and PagedKV addresses a head range inside every segment:
one run of memory on the CPU and HND layouts, one run per token on NHD.

The modules: `tp_mapping` (pure: the geometry, TP ranks, the head mapping), `spans` and `signature`
(pure: merging contiguous spans; comparing handshake signatures), `block_addresses` (pure: the
stride arithmetic behind the spans, which decode hands prefill instead of a span list), `span_table`
(torch on the host: a zero-copy chunk's spans and their merge as arrays), `block_words` (a layer's
blocks as strided runs of words, for a kernel that reads them in place), `layer_layout` (a layer
tensor's shape and strides read) and `paged_kv` (torch: the caches' block access).
"""

from dllm_connector.layout.block_addresses import BlockAddresses, LayerAddress
from dllm_connector.layout.layer_layout import LayerLayout, layer_layout
from dllm_connector.layout.paged_kv import PagedKV
from dllm_connector.layout.signature import signature_mismatches
from dllm_connector.layout.spans import coalesce_runs
from dllm_connector.layout.tp_mapping import (
    Geometry,
    HeadRange,
    LayoutError,
    TPMapping,
    TPMappingError,
    TPRank,
    head_split_problem,
    plan_tp_mapping,
    rank_heads,
)

__all__ = [
    "BlockAddresses",
    "Geometry",
    "HeadRange",
    "LayerAddress",
    "LayerLayout",
    "LayoutError",
    "PagedKV",
    "TPMapping",
    "TPMappingError",
    "TPRank",
    "coalesce_runs",
    "head_split_problem",
    "layer_layout",
    "plan_tp_mapping",
    "rank_heads",
    "signature_mismatches",
]
