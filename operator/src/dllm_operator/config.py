"""Operator configuration: defaults that come from the operator's deployment, not from a CR."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_ENGINE_IMAGE = "ghcr.io/dllm-operator/vllm:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/dllm-operator/router:0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    engine_image: str = DEFAULT_ENGINE_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE
    cluster_domain: str = "cluster.local"
    # Empty: every namespace (cluster mode).
    namespaces: tuple[str, ...] = field(default_factory=tuple)
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        namespaces = tuple(ns.strip() for ns in env.get("DLLM_WATCH_NAMESPACES", "").split(",") if ns.strip())
        return cls(
            engine_image=env.get("DLLM_ENGINE_IMAGE", DEFAULT_ENGINE_IMAGE),
            router_image=env.get("DLLM_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE),
            cluster_domain=env.get("DLLM_CLUSTER_DOMAIN", "cluster.local"),
            namespaces=namespaces,
            log_level=env.get("DLLM_LOG_LEVEL", "INFO").upper(),
        )
