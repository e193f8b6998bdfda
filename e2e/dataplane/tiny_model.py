"""A tiny Llama with a local byte-level tokenizer, made and trained at test time: nothing downloaded.

2 layers, hidden 128, head_dim 64 (vLLM's CPU attention needs 64 or more), 4 query heads and 2 KV heads
(so KV transfer has more than one head to place), saved in bf16. It is trained for seconds of CPU on
the short chats of tiny_corpus.py, from a fixed seed, so that it answers in words and its greedy
predictions are confident (tests compare them across engines). One build per version of this file and
the corpus, kept in the cache (tiny-llama-builds/<hash>) and copied to wherever a test wants the model.
Usage: python -m e2e.dataplane.tiny_model OUT_DIR
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.dataplane import tiny_corpus

# Training: random windows of the corpus, long enough to hold a question and its answer.
TRAIN_STEPS = 400
WARMUP_STEPS = 40
WINDOW = 192
BATCH = 8
LEARNING_RATE = 3e-3
# Loss (nats per byte) the training must reach: the corpus learnt, not merely its letters.
LEARNT_LOSS = 0.15
STAMP = "builder.sha256"

SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
# A plain "role: content" chat format, so /v1/chat/completions works (vLLM needs a template).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def byte_level_tokenizer(out: Path) -> Any:
    """A tokenizer with one token per byte (plus specials), saved in `out` and returned."""
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
    return fast


def builder_hash() -> str:
    """This file's and the corpus's bytes: a change to either makes a new model."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + Path(tiny_corpus.__file__).read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    """As tools/venv.sh places its cache: DLLM_CACHE, else $XDG_CACHE_HOME/dllm, else ~/.cache/dllm."""
    home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("DLLM_CACHE", home_cache / "dllm"))


def train(model: Any, ids: list[int], seed: int) -> float:
    """Next-byte prediction over random windows of `ids`; returns the last batch's loss."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, WARMUP_STEPS)
    cool = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, TRAIN_STEPS - WARMUP_STEPS)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cool], [WARMUP_STEPS])
    model.train()
    loss = float("inf")
    for _ in range(TRAIN_STEPS):
        starts = torch.randint(0, len(ids) - WINDOW, (BATCH,), generator=generator).tolist()
        batch = torch.stack([data[start : start + WINDOW] for start in starts])
        step = model(input_ids=batch, labels=batch).loss
        step.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        loss = float(step)
    model.eval()
    return loss


def make(out: Path, seed: int = 0) -> None:
    """Config, trained weights and tokenizer into `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
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
    ids = tokenizer(tiny_corpus.text() * 2, add_special_tokens=False)["input_ids"]
    loss = train(model, ids, seed)
    if loss > LEARNT_LOSS:
        raise RuntimeError(f"the tiny model did not learn its corpus: loss {loss:.3f} > {LEARNT_LOSS}")
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)


def build(out: Path, seed: int = 0) -> Path:
    """The trained model in `out`: copied from the cache's build of this version (made there first if
    there is none), unless `out` already holds it."""
    return cached_build(out, "tiny-llama-builds", builder_hash(), make, seed)


def cached_build(out: Path, kind: str, wanted: str, maker: Callable[[Path, int], None], seed: int) -> Path:
    """`maker`'s model in `out`, built once per `wanted` hash and seed in the cache's `kind` folder."""
    stamp = out / STAMP
    if stamp.exists() and stamp.read_text() == wanted:
        return out
    built = cache_dir() / kind / f"{wanted}-{seed}"
    if not (built / STAMP).exists():
        built.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=built.parent) as scratch:
            maker(Path(scratch) / "model", seed)
            (Path(scratch) / "model" / STAMP).write_text(wanted)
            if not (built / STAMP).exists():  # another process may have finished first
                shutil.rmtree(built, ignore_errors=True)
                os.replace(Path(scratch) / "model", built)
    out.mkdir(parents=True, exist_ok=True)
    for leftover in out.iterdir():  # an older version's files
        if leftover.is_file():
            leftover.unlink()
    for file in built.iterdir():
        shutil.copy2(file, out / file.name)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
