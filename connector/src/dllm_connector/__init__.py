"""dllm data plane: KV-transfer settings, the dllm-serve entrypoint, the KV connector, the PD router."""
