"""The CPU PD pipeline: real vLLM engines configured from the operator's rendering, plus dllm-router."""
