"""dllm-operator: reconciles DisaggregatedLLM resources into prefill/decode StatefulSets and a router."""

__version__ = "0.1.0"
