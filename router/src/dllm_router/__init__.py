"""dllm-router: one OpenAI-compatible endpoint that drives prefill then decode (docs/router.md)."""
