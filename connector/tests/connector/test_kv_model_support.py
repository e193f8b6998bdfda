"""Models whose state is not attention KV are refused at engine start, by name and with the reason
(issue 35): a hybrid state-space model (its per-request state lives outside the paged cache, so decode
would silently recompute or run on nothing) and an attention-free one. Plain, MLA and sliding-window
models pass. vLLM's ModelConfig is stood in for by a double that answers the properties read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dllm_connector import connector
from dllm_connector.model_support import unsupported_reason


def model_config_double(**flags: bool) -> SimpleNamespace:
    """Stands in for vLLM 0.32's ModelConfig: its `model`, `is_hybrid` and `is_attention_free`."""
    plain = {"model": "acme/tiny-nemotron-h", "is_hybrid": False, "is_attention_free": False}
    return SimpleNamespace(**(plain | flags))


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"is_hybrid": True}, "hybrid model: its state-space or linear-attention layers"),
        ({"is_attention_free": True}, "has no attention layers"),
    ],
)
def test_a_model_whose_state_is_not_attention_kv_is_refused_at_start_by_name(
    flags: dict[str, bool], said: str
) -> None:
    config = SimpleNamespace(model_config=model_config_double(**flags))
    with pytest.raises(ValueError, match="dllm KV connector: acme/tiny-nemotron-h") as refused:
        connector._DllmConnector(config, None)
    assert said in str(refused.value)
    assert "without prefill/decode disaggregation" in str(refused.value)


def test_attention_models_pass() -> None:
    assert unsupported_reason(model_config_double()) is None
    assert unsupported_reason(model_config_double(use_mla=True)) is None
