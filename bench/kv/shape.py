"""The KV every row moves: a 32-layer model's paged KV, bf16, in vLLM's CPU layout."""

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 32, 16, 8, 128
