"""The KV-compatibility fingerprint of a resource's engines: a short hash of everything that must agree
for KV to move from a prefill pod to a decode pod, and of nothing else. Pure.

What goes in: each role's image (the connector and vLLM versions ride with it), the model and its
revision, and the vLLM flags that shape the KV cache or its sharding (block size, dtypes, quantization,
tensor and pipeline parallel sizes), read from the rendered arguments with the role's extraArgs last,
as vLLM reads them; the KV transfer's connector, compression, protocol and custom class; and the
auth Secret both ends take their side-channel key from (none without authentication). What stays
out: batch limits, ports, resources, probes, placement, env, timeouts: a change to those rolls one
role as before, and its new pods pair with the old ones.

Both roles' pods carry the same value (labels.KV_FINGERPRINT, and the LWS DisaggregatedSet revision
label, so llm-d-router's revision screener pairs them too) and DLLM_KV_FINGERPRINT in their env.
"""

from __future__ import annotations

from typing import Any

from dllm_operator.api import DisaggregatedLLM
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth
from dllm_operator.render.digest import digest
from dllm_operator.render.engine_command import EngineRole, engine_args, role_spec, transfer_protocol

# vLLM flags that change the KV cache's layout, contents or sharding.
KV_FLAGS = (
    "--model",
    "--revision",
    "--tokenizer",
    "--block-size",
    "--dtype",
    "--kv-cache-dtype",
    "--quantization",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
)
LENGTH = 10  # hex characters: a label value, unique enough among a resource's few revisions


def kv_flags(args: list[str]) -> dict[str, str]:
    """The KV_FLAGS among `args` (`--flag value` or `--flag=value`), each at its last value."""
    found: dict[str, str] = {}
    for index, arg in enumerate(args):
        flag, _, inline = arg.partition("=")
        if flag not in KV_FLAGS:
            continue
        if inline or "=" in arg:
            found[flag] = inline
        elif index + 1 < len(args):
            found[flag] = args[index + 1]
    return found


def role_part(cr: DisaggregatedLLM, role: EngineRole, config: OperatorConfig) -> dict[str, Any]:
    image = role_spec(cr, role).image or cr.spec.image or config.engine_image
    return {"image": image, "flags": kv_flags(engine_args(cr, role))}


def kv_fingerprint(cr: DisaggregatedLLM, config: OperatorConfig) -> str:
    kv = cr.spec.kv_transfer
    parts = {
        "prefill": role_part(cr, "prefill", config),
        "decode": role_part(cr, "decode", config),
        "transfer": {
            "connector": str(kv.connector),
            "compression": str(kv.compression),
            "protocol": str(transfer_protocol(cr)),
            "custom": kv.custom.connector_class if kv.custom is not None else "",
            "auth": auth.secret_name(cr) if cr.spec.security.authentication else "",
        },
    }
    return digest(parts, LENGTH)
