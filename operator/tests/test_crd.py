"""The CRD generated from the typed model: the transform's rules, and that what the API server fills in
and checks comes from the model (the k8s admission tests run the same cases on the real API server)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from dllm_cases import SAMPLES, load_cr, minimal
from pydantic import BaseModel, Field

from dllm_contract.kvconfig import (
    DEFAULT_BUFFER_SIZE_GB,
    DEFAULT_HOLD_SECONDS,
    DEFAULT_KV_PORT,
    DEFAULT_PREFILL_WAIT_MS,
    DEFAULT_TRANSFER_THRESHOLD_TOKENS,
    DEFAULT_TRANSFER_TIMEOUT_MS,
)
from dllm_operator import api, crd

Schema = dict[str, Any]


def apply_defaults(schema: Schema, value: Any) -> Any:
    """Structural defaulting as the API server does it: a missing property with a default gets a copy of
    it, top down, so an object defaulted to {} then gets its own properties' defaults."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        value = {key: apply_defaults(schema["additionalProperties"], item) for key, item in value.items()}
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def root() -> Schema:
    schema: Schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_minimal_resource_gets_the_contract_defaults_from_the_crd() -> None:
    stored = apply_defaults(root(), minimal())
    assert stored["spec"]["kvTransfer"] == {
        "connector": "mooncake",
        "compression": "none",
        "port": DEFAULT_KV_PORT,
        "bufferSizeGB": DEFAULT_BUFFER_SIZE_GB,
        "transferThresholdTokens": DEFAULT_TRANSFER_THRESHOLD_TOKENS,
        "timeoutMs": DEFAULT_TRANSFER_TIMEOUT_MS,
        "prefillWaitMs": DEFAULT_PREFILL_WAIT_MS,
        "holdSeconds": DEFAULT_HOLD_SECONDS,
        "async": True,
        "protocol": "",
        "loadFailurePolicy": "fail",
    }
    assert stored["spec"]["decode"]["enableChunkedPrefill"] is False
    assert "enableChunkedPrefill" not in stored["spec"]["prefill"]
    # Empty defaults mean unset: nothing a policy's has() would see.
    for absent in ("image", "serviceAccountName", "imagePullSecrets"):
        assert absent not in stored["spec"]
    assert "resources" not in stored["spec"]["prefill"]
    assert "securityContext" not in stored["spec"]["decode"]


@pytest.mark.parametrize("path", [None, *SAMPLES], ids=lambda p: "minimal" if p is None else p.stem)
def test_crd_defaults_are_the_model_defaults(path: Path | None) -> None:
    body = minimal() if path is None else load_cr(path)
    defaulted = apply_defaults(root(), body)
    assert api.parse(defaulted).spec == api.parse(body).spec
    # and parsing writes nothing the CRD would have filled in differently
    assert apply_defaults(root(), defaulted) == defaulted


def described(schema: Schema, path: str) -> list[str]:
    missing = [] if "description" in schema else [path]
    for name, child in schema.get("properties", {}).items():
        missing += described(child, f"{path}.{name}")
    if schema.get("items", {}).get("type") == "object":  # a list of strings needs no word per item
        missing += described(schema["items"], f"{path}[]")
    return missing


def test_every_field_is_described() -> None:
    spec_and_status = {"properties": {k: root()["properties"][k] for k in ("spec", "status")}}
    assert described(spec_and_status, "")[1:] == []


def test_cel_rules_carry_the_messages_of_the_model_checks() -> None:
    spec = root()["properties"]["spec"]
    messages = [rule["message"] for rule in spec["x-kubernetes-validations"]]
    assert api.RDMA_PROTOCOL_NEEDS_RDMA in messages
    assert api.RUN_AS_USER_WITH_CAPABILITY in messages
    kv = spec["properties"]["kvTransfer"]["x-kubernetes-validations"]
    assert kv == [
        {
            "rule": "(has(self.connector) && self.connector == 'custom') == has(self.custom)",
            "message": api.CUSTOM_IFF_CUSTOM,
            "fieldPath": ".custom",
        }
    ]


# ---- the transform on small models ---------------------------------------------------------------


class Inner(BaseModel):
    """An inner object."""

    size: Annotated[int, Field(ge=1, description="A size.")] = 3


class Empty(BaseModel):
    note: str = Field("", description="Unset when empty.")


class Sample(BaseModel):
    ratio: float = Field(0.5, gt=0, description="Exclusive bound.")
    maybe: Annotated[int, Field(ge=0, le=9)] | None = Field(None, description="Optional.")
    inner: Inner = Field(Inner(), description="Defaulted object.")
    empty: Empty = Field(Empty(), description="Nothing to fill.")
    mode: Literal["", "a"] = Field(
        "", description="Empty is a choice.", json_schema_extra={api.EMPTY_DEFAULT_IS_A_CHOICE: True}
    )
    names: tuple[str, ...] = Field((), description="Empty list.")
    size: api.Quantity = Field("1Gi", description="A quantity.")
    free: api.FreeForm = Field(default_factory=dict, description="Passed through.")


def test_transform_makes_a_structural_schema() -> None:
    props = crd.model_schema(Sample)["properties"]
    assert props["ratio"] == {
        "type": "number",
        "description": "Exclusive bound.",
        "default": 0.5,
        "minimum": 0,
        "exclusiveMinimum": True,
    }
    assert props["maybe"] == {"type": "integer", "description": "Optional.", "minimum": 0, "maximum": 9}
    assert props["inner"]["default"] == {}
    assert props["inner"]["description"] == "Defaulted object."
    assert props["inner"]["properties"]["size"] == {
        "type": "integer",
        "description": "A size.",
        "default": 3,
        "minimum": 1,
    }
    assert "default" not in props["empty"]
    assert props["mode"]["default"] == ""
    assert "default" not in props["names"]
    assert props["size"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert props["size"]["x-kubernetes-int-or-string"] is True
    assert props["size"]["pattern"] == api.QUANTITY.pattern
    assert props["free"] == {
        "type": "object",
        "description": "Passed through.",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    text = str(crd.model_schema(Sample))
    for gone in ("$ref", "title", "null", "additionalProperties", api.EMPTY_DEFAULT_IS_A_CHOICE):
        assert gone not in text


class Union(BaseModel):
    either: int | str = Field(1, description="Neither int-or-string nor optional.")


class Loose(BaseModel):
    anything: dict[str, Any] = Field(default_factory=dict, description="Free-form, unmarked.")


class Overridden(BaseModel):
    inner: Inner = Field(Inner(size=5), description="Not what {} would give.")


@pytest.mark.parametrize(
    ("model", "words"), [(Union, "union"), (Loose, "free-form"), (Overridden, "model's defaults")]
)
def test_transform_refuses_what_has_no_structural_form(model: type[BaseModel], words: str) -> None:
    with pytest.raises(crd.SchemaError, match=words):
        crd.model_schema(model)
