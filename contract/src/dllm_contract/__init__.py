"""dllm's shared contract: what the operator, the engine and the router must agree on.

The KV-transfer settings and the env that carries them into an engine pod (`kvconfig`), and the
kv_transfer_params of a PD request (`pd_params`). Pydantic only, so every deployable may import it.
"""
