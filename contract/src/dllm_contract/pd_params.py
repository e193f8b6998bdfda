"""The `dllm` PD request protocol: the kv_transfer_params the router sends and the connector reads.

Pure and dependency-light (pydantic only): the router, the vLLM connector and the tests share it, so
the two ends of a request cannot disagree on a key.

A request is matched across engines by `transfer_id`, which the router makes per prompt (never by
vLLM's internal request ids, which differ between engines). The decode peer is named per request;
`VLLM_KV_DECODE_IP`/`VLLM_KV_DECODE_PORT` are only the single-decode fallback when a prefill request
names no peer. TP rank r of an engine listens on `kv_port + r`.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dllm_contract.types import Port

PROTOCOL_VERSION = 1
MAX_TRANSFER_ID = 256  # characters


class _Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    dllm: Literal[1] = 1  # PROTOCOL_VERSION
    transfer_id: str = Field(min_length=1, max_length=MAX_TRANSFER_ID)


class PrefillParams(_Params):
    """Sent to prefill (with max_tokens=1, n=1): push this prompt's KV to the named decode engine."""

    do_remote_decode: Literal[True] = True
    decode_host: str | None = None
    decode_kv_port: Port | None = None
    decode_engine_id: str | None = None  # checked at the handshake when given
    decode_tp_size: Annotated[int, Field(ge=1)] = 1


class DecodeParams(_Params):
    """Sent to decode: this prompt's KV arrives from prefill under `transfer_id`."""

    do_remote_prefill: Literal[True] = True
    prefill_host: str | None = None
    prefill_engine_id: str | None = None
    prefill_tp_size: Annotated[int, Field(ge=1)] = 1


def new_transfer_id(request_id: str, prompt_index: int) -> str:
    """One id per (client request, prompt); unique even when clients reuse request ids."""
    return f"{request_id}-{prompt_index}-{uuid.uuid4().hex[:12]}"


def is_dllm_params(params: dict[str, Any] | None) -> bool:
    return bool(params) and params is not None and params.get("dllm") == PROTOCOL_VERSION
