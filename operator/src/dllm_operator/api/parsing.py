"""parse(): a body to the typed resource, or SpecInvalid with every field path and reason."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dllm_contract.kvconfig import (
    Connector,
    Protocol,
)
from dllm_operator.api.autoscaling import hand_set_in_active_mode
from dllm_operator.api.common import DNS_1035, MAX_NAME_LENGTH
from dllm_operator.api.model_spec import TWO_SOURCES
from dllm_operator.api.resource import (
    NAME_TOO_LONG,
    NOT_DNS_1035,
    RDMA_PROTOCOL_NEEDS_RDMA,
    RUN_AS_USER_WITH_CAPABILITY,
    DisaggregatedLLM,
    Metadata,
    Spec,
    _short_batch,
)
from dllm_operator.api.roles import LOCALHOST_PROFILE, EngineSecurityContext
from dllm_operator.api.transfer import (
    CUSTOM_IFF_CUSTOM,
    HOST_DEVICES_NEED_RDMA,
    HOST_NETWORK_NEEDS_RDMA,
    RDMAMode,
    RDMASpec,
)

# ---- parsing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecInvalid(ValueError):
    """A DisaggregatedLLM the API server would refuse; `errors` name each field."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(str(error) for error in errors))
        self.errors = errors


def _dotted(location: tuple[int | str, ...]) -> str:
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _pydantic_errors(error: ValidationError) -> list[FieldError]:
    errors = []
    for item in error.errors():
        location = tuple(part for part in item["loc"] if not str(part).startswith("function-"))
        message = item["msg"].removeprefix("Value error, ")
        errors.append(FieldError(_dotted(location), message))
    return errors


def _metadata_errors(metadata: Mapping[str, Any]) -> list[FieldError]:
    name = str(metadata.get("name", ""))
    if not DNS_1035.match(name):
        return [FieldError("metadata.name", NOT_DNS_1035)]
    if len(name) > MAX_NAME_LENGTH:
        return [FieldError("metadata.name", NAME_TOO_LONG)]
    return []


def _cross_field_errors(spec: Spec) -> list[FieldError]:
    """The CRD's CEL rules (on the models above), with the same paths and messages."""
    errors = []
    kv = spec.kv_transfer
    if (kv.connector is Connector.CUSTOM) != (kv.custom is not None):
        errors.append(FieldError("spec.kvTransfer.custom", CUSTOM_IFF_CUSTOM))
    source = spec.model.source
    if source is not None and source.pvc is not None and source.hugging_face is not None:
        errors.append(FieldError("spec.model.source", TWO_SOURCES))
    if spec.rdma.mode is RDMAMode.HOST_DEVICES and not spec.rdma.enabled:
        errors.append(FieldError("spec.rdma.mode", HOST_DEVICES_NEED_RDMA))
    if spec.rdma.host_network and not spec.rdma.enabled:
        errors.append(FieldError("spec.rdma.hostNetwork", HOST_NETWORK_NEEDS_RDMA))
    if kv.protocol == Protocol.RDMA.value and not spec.rdma.enabled:
        errors.append(FieldError("spec.kvTransfer.protocol", RDMA_PROTOCOL_NEEDS_RDMA))
    for role_name, role in (("prefill", spec.prefill), ("decode", spec.decode)):
        errors += _security_context_errors(spec, role_name, role.security_context)
        max_len = spec.model.max_model_len
        if (
            max_len is not None
            and role.enable_chunked_prefill is False
            and role.max_num_batched_tokens < max_len
        ):
            errors.append(FieldError(f"spec.{role_name}.maxNumBatchedTokens", _short_batch(role_name)))
        if role.replicas is not None and role_name in spec.autoscaling.active_roles():
            errors.append(FieldError(f"spec.{role_name}.replicas", hand_set_in_active_mode(role_name)))
    return errors


def rdma_adds_capabilities(rdma: RDMASpec) -> bool:
    """IPC_LOCK (ipcLock) or SYS_RESOURCE (hostDevices): engines then run as root, the only user
    Kubernetes gives added capabilities to."""
    return rdma.enabled and (rdma.ipc_lock or rdma.mode is RDMAMode.HOST_DEVICES)


def _security_context_errors(spec: Spec, role: str, context: EngineSecurityContext) -> list[FieldError]:
    path = f"spec.{role}.securityContext"
    errors = []
    seccomp = context.seccomp_profile
    if seccomp is not None and (seccomp.type == "Localhost") != (seccomp.localhost_profile is not None):
        errors.append(FieldError(f"{path}.seccompProfile.localhostProfile", LOCALHOST_PROFILE))
    if context.run_as_user is not None and rdma_adds_capabilities(spec.rdma):
        errors.append(FieldError(f"{path}.runAsUser", RUN_AS_USER_WITH_CAPABILITY))
    return errors


def parse(body: Mapping[str, Any]) -> DisaggregatedLLM:
    """Parse a DisaggregatedLLM (a CR body or a file); raises SpecInvalid naming every bad field."""
    metadata = body.get("metadata") or {}
    errors = _metadata_errors(metadata)
    if body.get("spec") is None:
        raise SpecInvalid([*errors, FieldError("spec", "Required value")])
    try:
        # Strict JSON validation: "8" is not an integer and "yes" is not a boolean, as for the API server.
        spec = Spec.model_validate_json(json.dumps(body["spec"]), strict=True)
    except ValidationError as error:
        located = [FieldError(f"spec.{e.path}", e.message) for e in _pydantic_errors(error)]
        raise SpecInvalid(errors + located) from None
    errors += _cross_field_errors(spec)
    if errors:
        raise SpecInvalid(errors)
    return DisaggregatedLLM(metadata=Metadata.model_validate(metadata), spec=spec)
