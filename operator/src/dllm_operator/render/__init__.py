"""Pure rendering: a DisaggregatedLLM to the child objects the operator applies.

No kopf, no API client (an import-linter contract enforces it). Each child carries a hash of itself in
an annotation, so the operator can skip an apply that would change nothing.
"""

from __future__ import annotations

from typing import Any

from dllm_operator.api import DisaggregatedLLM, SpecInvalid
from dllm_operator.config import OperatorConfig
from dllm_operator.render import engine, netpol, policy, router
from dllm_operator.render.digest import digest
from dllm_operator.render.engine_command import EngineRole

HASH_ANNOTATION = "disagg.dev/desired-hash"
ROLES: tuple[EngineRole, ...] = ("prefill", "decode")


def desired_hash(manifest: dict[str, Any]) -> str:
    return digest(manifest)


def with_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    metadata = manifest["metadata"]
    annotations = {**metadata.get("annotations", {}), HASH_ANNOTATION: desired_hash(manifest)}
    return {**manifest, "metadata": {**metadata, "annotations": annotations}}


def render_all(cr: DisaggregatedLLM, config: OperatorConfig | None = None) -> list[dict[str, Any]]:
    """Every child the spec wants, in apply order (policies, then Services before the workloads that use
    them). Raises SpecInvalid, naming the fields, for what the operator's configuration refuses."""
    config = config or OperatorConfig()
    refused = policy.refused(cr, config)
    if refused:
        raise SpecInvalid(refused)
    children: list[dict[str, Any] | None] = [*netpol.network_policies(cr, config)]
    for role in ROLES:
        children += [
            engine.headless_service(cr, role),
            engine.statefulset(cr, role, config),
            engine.disruption_budget(cr, role),
        ]
    if cr.spec.router.enabled:
        children += [router.router_service(cr), router.router_deployment(cr, config)]
    return [with_hash(child) for child in children if child is not None]
