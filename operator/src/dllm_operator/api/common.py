"""The API group, the schema markers crd.py reads, and the field types every part shares."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from dllm_contract.kv_fingerprint import ENV_KV_FINGERPRINT
from dllm_contract.kvconfig import (
    CONTRACT_ENV_NAMES,
)

GROUP = "disagg.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedLLM"
PLURAL = "disaggregatedllms"

# Env names the operator sets beside the KV-transfer contract: the auth Secret's keys (render/auth.py)
# Mooncake's port range (render/ports.py) and the KV fingerprint (render/fingerprint.py). A role's `env`
# may not use them either.
OPERATOR_ENV_NAMES: tuple[str, ...] = (
    "DLLM_KV_AUTH_TOKEN",
    "VLLM_API_KEY",
    "DLLM_ENGINE_API_KEY",
    "DLLM_KV_TRANSFER_PORTS",
    ENV_KV_FINGERPRINT,
)
# Where huggingface_hub sends its requests, HF_TOKEN attached (NEW-4): a resource naming the address
# could send the hub token anywhere. A mirror is the operator's setting (DLLM_HF_ENDPOINT), not a
# resource's. HF_HUB_* names are reserved too (some name addresses, files or certificates), except
# these switches, which name neither.
HUB_ADDRESS_ENV = "HF_ENDPOINT"
HUB_ENV_PREFIX = "HF_HUB_"
HUB_SWITCHES: tuple[str, ...] = (
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DOWNLOAD_TIMEOUT",
    "HF_HUB_ENABLE_HF_TRANSFER",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_OFFLINE",
)
# Which certificate authorities the engines' HTTPS clients trust (Python's ssl, httpx, requests, curl).
# With one of the resource's choosing, a proxy it names reads the hub token inside TLS; a private CA
# belongs in the image.
CA_TRUST_ENV_NAMES: tuple[str, ...] = (
    "CURL_CA_BUNDLE",
    "REQUESTS_CA_BUNDLE",
    "SSL_CERT_DIR",
    "SSL_CERT_FILE",
)
RESERVED_ENV_NAMES: tuple[str, ...] = tuple(
    sorted({*CONTRACT_ENV_NAMES, *OPERATOR_ENV_NAMES, HUB_ADDRESS_ENV, *CA_TRUST_ENV_NAMES})
)


def env_name_reserved(name: str) -> bool:
    """Whether a role's `env` may not set `name` (the CRD's rule says the same in CEL)."""
    return name in RESERVED_ENV_NAMES or (name.startswith(HUB_ENV_PREFIX) and name not in HUB_SWITCHES)


MAX_NAME_LENGTH = 44
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes' own resource.Quantity syntax.
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


# ---- Kubernetes schema markers (read by crd.py) ---------------------------------------------------

INT_OR_STRING: JsonDict = {"x-kubernetes-int-or-string": True}
# Free-form objects: core types passed through as is (the API server keeps any field under them).
PRESERVE_UNKNOWN: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}
# The CRD leaves out empty defaults ('', [], {}): they mean "unset", and CEL's has() stays false. A field
# marked so has an empty default that is a choice of its own (listed in its enum), written like any other.
EMPTY_DEFAULT_IS_A_CHOICE = "x-dllm-empty-default-is-a-choice"


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """One x-kubernetes-validations entry; `field_path` is relative to where the rule sits."""
    entry: JsonDict = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def rules(*entries: JsonDict) -> JsonDict:
    return {"x-kubernetes-validations": list(entries)}


# ---- shared field types ---------------------------------------------------------------------------

Name = Annotated[str, Field(max_length=253)]
TensorParallelSize = Literal[1, 2, 4, 8, 16, 32, 64]
FreeForm = Annotated[dict[str, Any], Field(json_schema_extra=PRESERVE_UNKNOWN)]


def _check_quantity(value: str | int) -> str | int:
    if isinstance(value, str) and not QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a quantity (e.g. 16Gi, 500m, 2)")
    return value


Quantity = Annotated[
    str | int,
    AfterValidator(_check_quantity),
    Field(description="A quantity.", json_schema_extra={**INT_OR_STRING, "pattern": QUANTITY.pattern}),
]

OPTED_IN = "namespaces an admin labelled dllm.dev/allow-privileged-engines=true"
CONTROL_PLANE_NOTE = (
    "The chart's admission policy refuses node-role.kubernetes.io/control-plane (or master) here, and "
    f"tolerating that taint, outside {OPTED_IN}."
)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)
