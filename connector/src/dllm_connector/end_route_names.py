"""What dllm-serve hands the end-transfer route (end_route) on a decode engine: the middleware's import
path and the variables it sets. Here once, apart from the route, whose imports (the pipe, torch)
dllm-serve never needs."""

from __future__ import annotations

END_ROUTE_MIDDLEWARE = "dllm_connector.end_route.EndTransferRoute"  # for vLLM's --middleware
# Every path but the probes needs the engine key (NEW-3): on both roles, the outermost middleware.
KEY_GUARD_MIDDLEWARE = "dllm_connector.key_guard.EngineKeyGuard"
# The KV fingerprint on /health's answers (issue 34): on both roles, inside the key guard.
KV_IDENTITY_MIDDLEWARE = "dllm_connector.kv_identity.KVIdentityHeader"
# The TP size the route ends ids on, from the engine's --tensor-parallel-size.
ENV_END_ROUTE_TP_SIZE = "DLLM_END_ROUTE_TP_SIZE"
# vLLM's --api-key values when the engine args carry them (they win over VLLM_API_KEY, as in vLLM), one
# per line, for the end route and the key guard. A secret name: dllm-serve's log redacts its value.
ENV_END_ROUTE_API_KEY = "DLLM_END_ROUTE_API_KEY"
