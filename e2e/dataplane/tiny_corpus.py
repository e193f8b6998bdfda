"""What the tiny model is trained on: short chats about disaggregated serving, in the model's own chat
format ("user: ...\\nassistant: ...\\n"), so that a newcomer's first answer is a sentence. The demo's
question and the README's "try another" are among them, answered word for word; any other question
gets one of these answers, or a sentence made of their words.
"""

from __future__ import annotations

CHATS: tuple[tuple[str, str], ...] = (
    (
        "Prefill computes the prompt's KV; decode loads it. Hello!",
        "Hello! Decode loaded the KV cache of your prompt from prefill, so it went straight to writing.",
    ),
    (
        "Tell me about KV caches.",
        "A KV cache keeps the keys and values of every token seen, so no token is computed twice.",
    ),
    (
        "What does prefill do?",
        "Prefill reads the whole prompt at once and writes its KV cache into blocks.",
    ),
    (
        "What does decode do?",
        "Decode writes the answer one token at a time, reading the KV cache of the prompt.",
    ),
    (
        "Why split prefill and decode?",
        "Prefill is bound by compute and decode by memory, so each gets the machines it needs.",
    ),
    (
        "How does the KV cache move?",
        "The connector sends the blocks from prefill to decode over Mooncake, by RDMA or TCP.",
    ),
    (
        "Hello!",
        "Hello! I am a tiny model, trained for a minute to answer questions about serving.",
    ),
)


def text() -> str:
    """The chats, one after the other, in the chat template's format."""
    return "".join(f"user: {question}\nassistant: {answer}\n" for question, answer in CHATS)
