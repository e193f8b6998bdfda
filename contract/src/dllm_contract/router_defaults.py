"""What the operator renders for the router and the router assumes when it is not told: each once."""

from __future__ import annotations

# vLLM's MooncakeConnector bootstrap server on prefill, which the router queries in the mooncake flow
# (the operator's NetworkPolicy opens it to the router).
MOONCAKE_BOOTSTRAP_PORT = 8998
# The largest request body the router accepts, in MiB, when nothing sizes it from a memory limit
# (H2: a body expands several times once parsed; docs/router.md gives the figures).
DEFAULT_MAX_BODY_MB = 8
# The bytes of client bodies and engine answers the router holds at once, in MiB, when nothing sizes it
# from a memory limit (NEW-1: a quarter of the default 1 GiB; docs/router.md gives the copies it allows).
DEFAULT_MEMORY_BUDGET_MB = 256
# The engine answers one request may hold, in MiB, likewise (NEW-1: a quarter of the budget).
DEFAULT_MAX_ANSWER_MB = 64
# The HTTP port of an engine (vLLM's own default) and of the router, where nothing else is said.
DEFAULT_HTTP_PORT = 8000
# How long the router lets one upstream request run, streams included (dllm-router --request-timeout-s).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# How often the router re-checks that each prefill/decode pair moves KV (dllm-router
# --kv-check-interval-s; a new pair is checked at once). One canary of a few tokens per pair per
# interval: small next to any real load, frequent enough to see a broken path within minutes.
KV_CHECK_INTERVAL_S = 300.0
