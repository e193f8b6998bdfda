"""The DisaggregatedLLM CRD, generated from the typed model in api/ (what controller-gen is to Go types).

pydantic writes the model's JSON schema (validation mode, by alias); `structural` turns it into the
Kubernetes structural schema: $refs inlined, Optional (anyOf with null) made the plain type, numeric
exclusive bounds in OpenAPI v3.0 form, titles and `additionalProperties: false` dropped (the API server
refuses unknown fields itself), and defaults written as the CRD needs them. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from dllm_operator.api import (
    EMPTY_DEFAULT_IS_A_CHOICE,
    GROUP,
    INT_OR_STRING,
    KIND,
    PLURAL,
    PRESERVE_UNKNOWN,
    VERSION,
    DisaggregatedLLM,
    Spec,
    Status,
)

Schema = dict[str, Any]

NAME = f"{PLURAL}.{GROUP}"
HEADER = "# Generated from operator/src/dllm_operator/api/ by `make crds`; edit the model, not this file.\n"
PRINTER_COLUMNS: list[Schema] = [
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.ready"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Connector", "type": "string", "jsonPath": ".spec.kvTransfer.connector"},
    {
        "name": "KV",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="KVTransferVerified")].reason',
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
SCALE = {
    "specReplicasPath": ".spec.decode.replicas",
    "statusReplicasPath": ".status.decode.replicas",
    "labelSelectorPath": ".status.decode.selector",
}
# Key order in the written YAML, for reading; keys not listed follow in pydantic's order.
ORDER = ("type", "description", "format", "enum", "default", "minimum", "exclusiveMinimum", "maximum")
INT_OR_STRING_KEY = next(iter(INT_OR_STRING))
PRESERVE_KEY = next(iter(PRESERVE_UNKNOWN))


class SchemaError(ValueError):
    """The model uses a JSON-schema shape that has no structural equivalent here."""


def _is_empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


def _ordered(schema: Schema) -> Schema:
    first = {key: schema[key] for key in ORDER if key in schema}
    return first | {key: value for key, value in schema.items() if key not in first}


def _without_null(options: list[Schema]) -> list[Schema]:
    return [option for option in options if option.get("type") != "null"]


def _merge_ref(node: Schema, defs: dict[str, Schema]) -> Schema:
    """A $ref (or a single-entry allOf/anyOf after nulls are dropped) becomes its target, with the
    referring node's own keys (description, default, extras) over the target's."""
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**{k: v for k, v in node.items() if k != "allOf"}, **node["allOf"][0]}
    if "anyOf" in node and INT_OR_STRING_KEY not in node:
        options = _without_null(node["anyOf"])
        if len(options) != 1:
            raise SchemaError(f"a union other than X | None needs {INT_OR_STRING_KEY}: {node['anyOf']}")
        node = {**options[0], **{k: v for k, v in node.items() if k != "anyOf"}}
    if "$ref" in node:
        target = defs[node["$ref"].removeprefix("#/$defs/")]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _merge_ref(node, defs)
    return node


def _unset(value: Any) -> bool:
    return _is_empty(value) or (isinstance(value, dict) and all(_unset(v) for v in value.values()))


def _fills_in(node: Schema, default: dict[str, Any]) -> bool:
    """Whether the API server, given `{}` for this object, fills in exactly the model's default object."""
    for name, child in node["properties"].items():
        value = default.get(name)
        if child.get("default") == {} and "properties" in child:
            if not isinstance(value, dict) or not _fills_in(child, value):
                return False
        elif "default" in child:
            if child["default"] != value:
                return False
        elif not _unset(value):
            return False
    return True


def _default(node: Schema, default: Any, empty_is_a_choice: bool) -> Any:
    """The default the CRD writes, or None for none. Empty values mean "unset" and are left out (so CEL's
    has() stays false) unless the field marks its empty default a choice; an object's default is written
    `{}`, letting the API server fill in the nested defaults, and only where there is one to fill."""
    if default is None:
        return None
    if node.get("type") == "object" and "properties" in node:
        if not _fills_in(node, default):
            raise SchemaError(
                f"an object's default must be its model's defaults, as {{}} fills in: {default}"
            )
        filled = any("default" in child for child in node["properties"].values())
        return {} if filled else None
    if _is_empty(default) and not empty_is_a_choice:
        return None
    return default


def structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """One node of pydantic's JSON schema as a Kubernetes structural schema node."""
    node = _merge_ref(node, defs)
    out: Schema = {}
    for key, value in node.items():
        if key in ("title", "$defs", "default", EMPTY_DEFAULT_IS_A_CHOICE):
            continue
        if key == "properties":
            out[key] = {name: structural(child, defs) for name, child in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = structural(value, defs)
            elif value is True and not node.get(PRESERVE_KEY):
                raise SchemaError(f"a free-form object needs {PRESERVE_KEY}: {node}")
        elif key == "description":  # a model's docstring keeps its line breaks
            out[key] = " ".join(value.split())
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "anyOf":  # int-or-string: Kubernetes wants exactly these two, types only
            out[key] = [{"type": "integer"}, {"type": "string"}]
        else:
            out[key] = value
    if "default" in node:
        default = _default(out, node["default"], bool(node.get(EMPTY_DEFAULT_IS_A_CHOICE)))
        if default is not None:
            out["default"] = default
    return _ordered(out)


def model_schema(model: type[BaseModel]) -> Schema:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return structural(schema, schema.get("$defs", {}))


def openapi_schema() -> Schema:
    """The CRD's openAPIV3Schema: the resource's description and rules, spec and status from the model."""
    resource = DisaggregatedLLM.model_json_schema(by_alias=True, mode="validation")
    return _ordered(
        {
            "type": "object",
            "description": " ".join(resource["description"].split()),
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},  # the API server's own; name rules below
                "spec": model_schema(Spec),
                "status": model_schema(Status),
            },
            "required": ["spec"],
            "x-kubernetes-validations": resource["x-kubernetes-validations"],
        }
    )


def crd() -> Schema:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["dllm"],
                "categories": ["all", "llm"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=110)
