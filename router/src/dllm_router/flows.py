"""The three PD request protocols as pure functions: which kv_transfer_params go to prefill and decode.

- `dllm` (this project's connector, push): prefill is told which decode pod to push to (PrefillParams),
  decode is told to wait for that prompt's KV (DecodeParams); both share a transfer id per prompt and
  are sent concurrently.
- `mooncake` (vLLM's MooncakeConnector, push): the same shape with vLLM's keys; decode needs the prefill
  pod's bootstrap address and its engine id (read from the bootstrap server's /query).
- `nixl` (vLLM's NixlConnector, pull): prefill first; what it returns in kv_transfer_params is
  forwarded to decode, which pulls the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dllm_contract.pd_params import MAX_TRANSFER_ID, DecodeParams, PrefillParams, new_transfer_id
from dllm_router.config import Flow, RouterConfig

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class PairPlan:
    """What one prompt's two calls carry. decode_kv None: forward what prefill returns (nixl)."""

    prefill_kv: JsonObject
    decode_kv: JsonObject | None
    concurrent: bool
    prefill_headers: bytes
    transfer_id: str | None = None
    # dllm (our connector) only: the id to end on decode when decode fails after prefill may have run
    # (M2; transfer_end.py). vLLM's own connectors have no such call.
    end_id: str | None = None


def is_concurrent(flow: Flow) -> bool:
    return flow != "nixl"


def dllm_plan(
    config: RouterConfig,
    request_id: str,
    index: int,
    prefill_host: str,
    decode_host: str,
    transfer_id: str | None = None,
) -> PairPlan:
    tid = new_transfer_id(request_id, index) if transfer_id is None else transfer_id
    prefill = PrefillParams(
        transfer_id=tid,
        decode_host=decode_host,
        decode_kv_port=config.decode_kv_port,
        decode_tp_size=config.decode_tp_size,
    )
    decode = DecodeParams(transfer_id=tid, prefill_host=prefill_host, prefill_tp_size=config.prefill_tp_size)
    return PairPlan(
        prefill_kv=prefill.model_dump(exclude_none=True),
        decode_kv=decode.model_dump(exclude_none=True),
        concurrent=True,
        prefill_headers=b"",
        transfer_id=tid,
        end_id=tid,
    )


class DllmPlans:
    """`dllm_plan`, with each pod pair's params validated and dumped once: per prompt only the transfer
    id changes, so it is put into copies of that pair's dumps (same keys, same order). A transfer id the
    protocol would refuse is left to the models, which raise as `dllm_plan` does."""

    MAX_PAIRS = 4096  # pods come and go: the cache is emptied rather than grown without bound

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._pairs: dict[tuple[str, str], tuple[JsonObject, JsonObject]] = {}

    def plan(self, request_id: str, index: int, prefill_host: str, decode_host: str) -> PairPlan:
        tid = new_transfer_id(request_id, index)
        if not 0 < len(tid) <= MAX_TRANSFER_ID:  # else the models refuse it, as in dllm_plan
            return dllm_plan(self.config, request_id, index, prefill_host, decode_host, tid)
        pair = self._pairs.get((prefill_host, decode_host))
        if pair is None:
            if len(self._pairs) >= self.MAX_PAIRS:
                self._pairs.clear()
            template = dllm_plan(self.config, "", 0, prefill_host, decode_host, "t")
            assert template.decode_kv is not None
            pair = self._pairs[(prefill_host, decode_host)] = (template.prefill_kv, template.decode_kv)
        return PairPlan(
            prefill_kv={**pair[0], "transfer_id": tid},
            decode_kv={**pair[1], "transfer_id": tid},
            concurrent=True,
            prefill_headers=b"",
            transfer_id=tid,
            end_id=tid,
        )


def bootstrap_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def mooncake_plan(
    request_id: str, index: int, bootstrap_addr: str, engine_id: str, dp_rank: int, dp_size: int
) -> PairPlan:
    # fresh randomness in every id (H9): two requests with the same X-Request-Id (a retry, an SDK's
    # constant, a copied id) must never share a transfer, or one decode could load the other's KV
    tid = "xfer-" + new_transfer_id(request_id, index)
    headers = f"X-data-parallel-rank: {dp_rank}\r\n".encode() if dp_size > 1 else b""
    return PairPlan(
        prefill_kv={"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
        decode_kv={
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": bootstrap_addr,
            "remote_engine_id": engine_id,
            "transfer_id": tid,
        },
        concurrent=True,
        prefill_headers=headers,
        transfer_id=tid,
    )


NIXL_PREFILL_KV: JsonObject = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


_NIXL_PLAN = PairPlan(prefill_kv=NIXL_PREFILL_KV, decode_kv=None, concurrent=False, prefill_headers=b"")


def nixl_plan() -> PairPlan:
    """The same for every prompt (read, never changed): one object, not one per request."""
    return _NIXL_PLAN


class BootstrapError(ValueError):
    """A bootstrap /query answer the router cannot use."""


def parse_bootstrap_query(answer: object) -> tuple[str, ...]:
    """vLLM's MooncakeBootstrapServer /query: {dp_rank: {"engine_id": ..., "worker_addr": ...}}.

    Returns the engine ids indexed by data-parallel rank.
    """
    if not isinstance(answer, dict) or not answer:
        raise BootstrapError("bootstrap /query returned no registered engine")
    try:
        ranks = sorted((int(rank), entry["engine_id"]) for rank, entry in answer.items())
    except (ValueError, TypeError, KeyError):
        raise BootstrapError(f"bootstrap /query answer is malformed: {answer!r:.200}") from None
    if [r for r, _ in ranks] != list(range(len(ranks))) or not all(isinstance(e, str) for _, e in ranks):
        raise BootstrapError(f"bootstrap /query answer has gaps or bad engine ids: {answer!r:.200}")
    return tuple(engine_id for _, engine_id in ranks)
