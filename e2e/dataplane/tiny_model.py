"""A tiny random-weight Llama with a local byte-level tokenizer, made at test time: nothing downloaded.

2 layers, hidden 128, head_dim 64 (vLLM's CPU attention needs 64 or more), 4 query heads and 2 KV heads
(so KV transfer has more than one head to place), bf16, a fixed seed so every run builds the same model.
Usage: python -m e2e.dataplane.tiny_model OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
# A plain "role: content" chat format, so /v1/chat/completions works (vLLM needs a template).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def byte_level_tokenizer(out: Path) -> int:
    """A tokenizer with one token per byte (plus specials); returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(SPECIALS)
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(symbol, len(vocab))
    tokenizer = Tokenizer(
        models.WordPiece(
            vocab=vocab, unk_token="<unk>", continuing_subword_prefix="", max_input_chars_per_word=1
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split("", "isolated"),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(vocab)


def build(out: Path, seed: int = 0) -> Path:
    """Write config, weights and tokenizer into `out` (skipped when a complete model is already there)."""
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = byte_level_tokenizer(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # Any: transformers types `.to` through a decorator that mypy reads as taking a model
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    with (
        torch.no_grad()
    ):  # larger weights than the default init, so greedy decoding does not collapse at once
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
