"""The connector's metrics on vLLM's own /metrics, through vLLM's per-connector hook.

vLLM gathers each worker's `get_kv_connector_stats()` (counts since the last report, levels, and
the seconds of each transfer) into the engine's stats and hands them, per engine, to `observe`.
Names carry vLLM's `vllm:` prefix; prometheus_client adds `_total` to counters.

- `vllm:dllm_kv_sends_in_flight` (gauge): finished requests whose blocks wait for their push.
- `vllm:dllm_kv_data_path_info{path, transport, reason}` (1): the data path and transport in use.
- `vllm:dllm_kv_transfers_total{direction}`: transfers that ended with the KV in place.
- `vllm:dllm_kv_transfer_failures_total{direction, reason}`: timeout, checksum or other.
- `vllm:dllm_kv_bytes_total{direction, kind}`: kind `kv` is the KV moved, as the cache holds it;
  `wire` is what crossed the transport after the codec (equal with codec none).
- `vllm:dllm_kv_transfer_seconds{direction}` (histogram): one observation per transfer and decode
  rank, from connecting to decode's ack (send) or from the accepted offer to the ack (receive).
  GB/s is `rate(..._bytes_total{kind="kv"}) / rate(..._transfer_seconds_sum)`.
- `vllm:dllm_kv_codec_seconds_total{direction}`: seconds spent gathering and encoding the KV (send) or
  decoding and placing it (receive), summed over transfers; its rate over the transfer seconds' is the
  share of a transfer the codec takes. On a GPU this is the host's time to issue the work.
- `vllm:dllm_kv_queue_seconds{direction}` (histogram, prefill): one observation per send and decode
  rank, from the request's end at prefill (its blocks held for the send) to the side channel taking
  the send (decode's slot free).

`direction` is the engine's KV role: `send` (prefill), `receive` (decode) or `both`.
"""

from __future__ import annotations

from typing import Any

SENDS_IN_FLIGHT_METRIC = "vllm:dllm_kv_sends_in_flight"
DATA_PATH_METRIC = "vllm:dllm_kv_data_path_info"
TRANSFERS_METRIC = "vllm:dllm_kv_transfers"
FAILURES_METRIC = "vllm:dllm_kv_transfer_failures"
BYTES_METRIC = "vllm:dllm_kv_bytes"
SECONDS_METRIC = "vllm:dllm_kv_transfer_seconds"
CODEC_METRIC = "vllm:dllm_kv_codec_seconds"
QUEUE_METRIC = "vllm:dllm_kv_queue_seconds"

# From a millisecond (a few blocks on one host) to a minute (the largest transfer timeout).
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def direction(kv_role: str | None) -> str:
    return {"kv_producer": "send", "kv_consumer": "receive"}.get(kv_role or "", "both")


def failures_by_reason(data: dict[str, Any]) -> dict[str, int]:
    """The failed transfers of one report, each under one reason: the counts of timeouts and checksum
    failures, and the rest as `other` (never below 0: a checksum failure on each of several ranks
    fails one transfer)."""
    timeouts = int(data.get("timeouts", 0))
    checksum = int(data.get("checksum_failures", 0))
    failed = int(data.get("failed_sends", 0)) + int(data.get("failed_receives", 0))
    return {"timeout": timeouts, "checksum": checksum, "other": max(0, failed - timeouts - checksum)}


def prom_metrics_class() -> Any:
    """vLLM's per-connector Prometheus hook, subclassed where vLLM is installed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.metrics.utils import create_metric_per_engine

    class DllmPromMetrics(KVConnectorPromMetrics):
        """The metrics above, one child per engine (vLLM's labels model_name and engine first)."""

        def __init__(
            self,
            vllm_config: Any,
            metric_types: Any,
            labelnames: list[str],
            per_engine_labelvalues: dict[int, list[object]],
        ) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            transfer = vllm_config.kv_transfer_config
            self._direction = direction(getattr(transfer, "kv_role", None))
            gauge_cls: Any = self._gauge_cls  # vLLM's classes (prometheus_client's or Ray's)
            counter_cls: Any = self._counter_cls
            histogram_cls: Any = self._histogram_cls
            gauge = gauge_cls(
                name=SENDS_IN_FLIGHT_METRIC,
                documentation=(
                    "Finished requests whose KV cache blocks are held until their push to decode "
                    "ends (the dllm connector's in-flight sends)."
                ),
                labelnames=self._labelnames,
                multiprocess_mode="mostrecent",
            )
            self._sends_in_flight: dict[int, Any] = create_metric_per_engine(gauge, per_engine_labelvalues)
            self._data_path = gauge_cls(
                name=DATA_PATH_METRIC,
                documentation=(
                    "The dllm connector's KV data path (device, pinned-host or host), its transport "
                    "and why it was chosen: 1 for the path in use."
                ),
                labelnames=[*self._labelnames, "path", "transport", "reason"],
                multiprocess_mode="mostrecent",
            )
            self._transfers = counter_cls(
                name=TRANSFERS_METRIC,
                documentation="KV transfers of the dllm connector that ended with the KV in place.",
                labelnames=[*self._labelnames, "direction"],
            )
            self._failures = counter_cls(
                name=FAILURES_METRIC,
                documentation="KV transfers of the dllm connector that failed, by reason.",
                labelnames=[*self._labelnames, "direction", "reason"],
            )
            self._bytes = counter_cls(
                name=BYTES_METRIC,
                documentation=(
                    "Bytes the dllm connector moved: kind=kv the KV as the cache holds it, "
                    "kind=wire what crossed the transport after the codec."
                ),
                labelnames=[*self._labelnames, "direction", "kind"],
            )
            self._seconds = histogram_cls(
                name=SECONDS_METRIC,
                documentation="Seconds per KV transfer of the dllm connector (per decode rank).",
                labelnames=[*self._labelnames, "direction"],
                buckets=list(SECONDS_BUCKETS),
            )
            self._codec = counter_cls(
                name=CODEC_METRIC,
                documentation=(
                    "Seconds the dllm connector spent in its codec: gathering and encoding KV (send), "
                    "decoding and placing it (receive)."
                ),
                labelnames=[*self._labelnames, "direction"],
            )
            self._queue = histogram_cls(
                name=QUEUE_METRIC,
                documentation=(
                    "Seconds a KV send waited, from the request's end at prefill to decode's side "
                    "channel taking it (per decode rank)."
                ),
                labelnames=[*self._labelnames, "direction"],
                buckets=list(SECONDS_BUCKETS),
            )
            for engine_idx in per_engine_labelvalues:  # at 0 from the start: absent means no connector
                way = self._direction
                self._transfers.labels(*self._labels(engine_idx, way))
                for reason in ("timeout", "checksum", "other"):
                    self._failures.labels(*self._labels(engine_idx, way, reason))
                for kind in ("kv", "wire"):
                    self._bytes.labels(*self._labels(engine_idx, way, kind))
                self._seconds.labels(*self._labels(engine_idx, way))
                self._codec.labels(*self._labels(engine_idx, way))
                self._queue.labels(*self._labels(engine_idx, way))

        def _labels(self, engine_idx: int, *extra: str) -> list[object]:
            return [*self.per_engine_labelvalues[engine_idx], *extra]

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            if engine_idx not in self.per_engine_labelvalues:
                return
            data, way = transfer_stats_data, self._direction
            level = data.get("sends_in_flight")
            if level is not None and engine_idx in self._sends_in_flight:
                self._sends_in_flight[engine_idx].set(level)
            path = data.get("data_path")
            if path is not None:
                transport, reason = data.get("data_path_transport", ""), data.get("data_path_reason", "")
                self._data_path.labels(*self._labels(engine_idx, path, transport, reason)).set(1)
            transfers = int(data.get("sent", 0)) + int(data.get("received", 0))
            if transfers:
                self._transfers.labels(*self._labels(engine_idx, way)).inc(transfers)
            for reason, count in failures_by_reason(data).items():
                if count:
                    self._failures.labels(*self._labels(engine_idx, way, reason)).inc(count)
            for kind, key in (("kv", "raw_bytes"), ("wire", "bytes_on_wire")):
                if moved := int(data.get(key, 0)):
                    self._bytes.labels(*self._labels(engine_idx, way, kind)).inc(moved)
            for seconds in data.get("transfer_seconds", ()):
                self._seconds.labels(*self._labels(engine_idx, way)).observe(float(seconds))
            if codec_seconds := float(data.get("codec_seconds", 0.0)):
                self._codec.labels(*self._labels(engine_idx, way)).inc(codec_seconds)
            for seconds in data.get("queue_seconds", ()):
                self._queue.labels(*self._labels(engine_idx, way)).observe(float(seconds))

    return DllmPromMetrics
