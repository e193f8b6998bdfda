"""The per-CR Secret that authenticates the data plane: the KV side channel's HMAC key and the engines'
vLLM API key. Its values are random, so it is not rendered with the other children (a re-render would
change them): the controller creates it once, with create-only RBAC, and never reads it back. Pods
take its keys by secretKeyRef.

Its name, `<resource>-dllm-auth`, is one the chart's admission policy reserves for the operator
(NEW-10): with create-only rights the operator cannot tell its own Secret from one someone else made
first under the name, so nobody else may create one (or change its keys).
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from dllm_operator.api import DisaggregatedLLM
from dllm_operator.render import labels

KV_TOKEN_KEY = "kv-token"  # noqa: S105 - a key name, not a value
API_KEY_KEY = "api-key"
# Env names the Secret's keys are given under (the contract names are in dllm_contract.kvconfig).
KV_TOKEN_ENV = "DLLM_KV_AUTH_TOKEN"  # noqa: S105 - an env name
ENGINE_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: --api-key for every /v1 route
ROUTER_API_KEY_ENV = "DLLM_ENGINE_API_KEY"  # the router sends it to the engines as a Bearer token
_RANDOM_BYTES = 32
SECRET_SUFFIX = "-dllm-auth"  # noqa: S105 - a name the chart's reserved-secrets policy matches


def secret_name(cr: DisaggregatedLLM) -> str:
    return cr.name + SECRET_SUFFIX


def secret_ref(cr: DisaggregatedLLM, env_name: str, key: str) -> dict[str, Any]:
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": secret_name(cr), "key": key}}}


def new_secret(cr: DisaggregatedLLM, random_hex: Any = secrets.token_hex) -> dict[str, Any]:
    """A Secret with fresh random values; `random_hex(n)` returns 2n hex characters."""
    values = {KV_TOKEN_KEY: random_hex(_RANDOM_BYTES), API_KEY_KEY: random_hex(_RANDOM_BYTES)}
    meta = labels.metadata(cr, "router", secret_name(cr))
    meta["labels"] = labels.instance_selector(cr) | {labels.PART_OF: cr.name}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in values.items()},
    }
