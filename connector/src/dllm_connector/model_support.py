"""Which models this connector can disaggregate, decided from vLLM's model config at engine start. Pure.

It moves attention KV in paged blocks (per-head K and V, or MLA's latent). A hybrid model's state-space
or linear-attention layers (Jamba, Bamba, Nemotron-H, Qwen3-Next) keep a per-request state outside
those blocks, which it cannot move: decode would either recompute the prompt without saying so or
run on a state it never received. Such a model is refused at start, naming it and why (issue 35),
rather than served wrong. Sliding-window layers are attention KV, and move (docs/kv-connector.md).
"""

from __future__ import annotations

from typing import Any


def unsupported_reason(model_config: Any) -> str | None:
    """Why the dllm connector cannot move this model's KV, or None where it can."""
    name = str(getattr(model_config, "model", "this model"))
    if bool(getattr(model_config, "is_attention_free", False)):
        return (
            f"{name} has no attention layers, so no KV cache to move between engines: "
            "serve it without prefill/decode disaggregation"
        )
    if bool(getattr(model_config, "is_hybrid", False)):
        return (
            f"{name} is a hybrid model: its state-space or linear-attention layers keep a per-request "
            "state outside the paged KV cache, which the dllm connector does not move. Serve it "
            "without prefill/decode disaggregation, or with a connector that moves that state"
        )
    return None
