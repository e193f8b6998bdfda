"""Operator configuration: defaults that come from the operator's deployment, not from a CR."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_ENGINE_IMAGE = "ghcr.io/dllm-operator/vllm:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/dllm-operator/router:0.1.0"


class ConfigInvalid(ValueError):
    """An operator setting with a bad value; the message names the variable."""


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("true", "false"):
        raise ConfigInvalid(f"{name}: {raw!r} is not true or false")
    return raw == "true"


def _list(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in env.get(name, "").split(",") if item.strip())


@dataclass(frozen=True)
class OperatorConfig:
    engine_image: str = DEFAULT_ENGINE_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE
    cluster_domain: str = "cluster.local"
    # Empty: every namespace (cluster mode).
    namespaces: tuple[str, ...] = field(default_factory=tuple)
    log_level: str = "INFO"
    # H7: false refuses CRs asking for host network, host devices, other Secrets in env, network or
    # AppArmor annotations or tolerate-everything tolerations (render/policy.py), in every namespace.
    # The chart's admission policy does the same per namespace; this is for clusters without it.
    allow_privileged_engines: bool = True
    # Non-empty: every image a CR names must start with one of these (e.g. "registry.example.com/").
    allowed_image_prefixes: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        return cls(
            engine_image=env.get("DLLM_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
            router_image=env.get("DLLM_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE),
            cluster_domain=env.get("DLLM_CLUSTER_DOMAIN", "cluster.local"),
            namespaces=_list(env, "DLLM_WATCH_NAMESPACES"),
            log_level=env.get("DLLM_LOG_LEVEL", "INFO").upper(),
            allow_privileged_engines=_flag(env, "DLLM_ALLOW_PRIVILEGED_ENGINES", True),
            allowed_image_prefixes=_list(env, "DLLM_ALLOWED_IMAGE_PREFIXES"),
        )
