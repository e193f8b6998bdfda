"""Worker-side half of the dllm KV connector: torch and transports, no vLLM imports.

Owns the paged caches, one transport, a KVReceiver (decode, side channel on kv_port + TP rank)
and a KVSender (prefill). Where the two engines' TP sizes differ, each prefill rank sends the KV
heads it holds to every decode rank that needs them (layout.plan_tp_mapping). Each step it
starts the scheduler's plan and reports what ended; every receive is reported exactly once, as
loaded or failed, with the failed blocks listed. Decode always loads asynchronously;
async_transfer false makes prefill sends run inline in the engine step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from dllm_connector import codec, tuning
from dllm_connector.layout import Geometry, LayoutError, PagedKV, TPRank
from dllm_connector.peers import DecodePeers
from dllm_connector.pipe import span_checksum
from dllm_connector.pipe.common import PipeConfig, TransferFailed
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import StepPlan
from dllm_connector.transport.base import Transport
from dllm_connector.transport.placement import DataPath, PathSetting
from dllm_connector.transport.sidechannel import PeerAuth, connections_for
from dllm_contract import kvconfig
from dllm_contract.kvconfig import ConnectorExtraConfig, Protocol

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerIdentity:
    kv_port: int
    tp_rank: int = 0
    tp_size: int = 1
    sends: bool = True
    receives: bool = True
    engine_id: str | None = None
    max_num_seqs: int | None = None  # vLLM's scheduler_config.max_num_seqs (None: not known)


@dataclass
class StepResults:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


def make_transport(
    kind: str,
    extra: ConnectorExtraConfig,
    host: str,
    device: torch.device,
    setting: PathSetting = PathSetting.AUTO,
) -> Transport:
    """The transport for a connector class: 'mooncake', or 'nccl' (gloo where the staging is in host
    memory: a CPU cache, or a GPU cache told to take the host or pinned-host path)."""
    if kind == "mooncake":
        from dllm_connector.transport.mooncake import MooncakeTransport

        return MooncakeTransport(
            host,
            protocol=extra.protocol.value,
            devices=extra.rdma_devices,
            rpc_ports=extra.transfer_ports,
            timeout_s=extra.transfer_timeout_ms / 1000,
        )
    from dllm_connector.transport.torchdist import TorchDistTransport

    host_staging = setting in (PathSetting.HOST, PathSetting.PINNED_HOST)
    backend = "nccl" if device.type == "cuda" and not host_staging else "gloo"
    return TorchDistTransport(
        host, backend=backend, connect_timeout=extra.transfer_timeout_ms / 1000, require_admission=True
    )


class ConnectorWorker:
    def __init__(
        self,
        extra: ConnectorExtraConfig,
        geometry: Geometry,
        identity: WorkerIdentity,
        transport_kind: str,
    ) -> None:
        if extra.protocol is Protocol.RDMA and transport_kind != "mooncake":
            raise ValueError("protocol rdma needs the Mooncake connector")
        self.extra = extra
        self.config = PipeConfig(extra=extra)
        self.geometry = geometry
        self.identity = identity
        self.transport_kind = transport_kind
        self.host = extra.host_ip or "127.0.0.1"
        self.kv: PagedKV | None = None
        self.transport: Transport | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._loads: dict[str, tuple[str, tuple[int, ...]]] = {}  # transfer id -> (request id, blocks)
        self._sends: dict[str, str] = {}  # transfer id -> request id
        self._load_errors: set[int] = set()
        self.failures: dict[str, str] = {}  # transfer id -> why it failed (the latest 1000)
        self._refused: dict[str, tuple[tuple[int, ...], str]] = {}  # loads refused before starting
        self._cancelled: set[str] = set()  # transfer ids of loads vLLM aborted (no blocks to report)
        self._unsendable: dict[str, str | None] = {}  # sends this worker cannot do: reported failed
        self.data_path: str | None = None  # the path transfers take (set with the caches)
        self.data_path_reason = ""  # and why, in words

    def register_kv_caches(self, caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        tp = TPRank(self.identity.tp_rank, self.identity.tp_size)
        self.kv = PagedKV(caches, num_blocks, self.geometry, tp=tp)
        # The side channel's key comes from the worker's environment, never from the kv-transfer
        # config (that JSON is on vLLM's command line and in its logs).
        token = kvconfig.side_channel_token(os.environ)
        auth = PeerAuth.from_token(token) if token is not None else None
        # The engine's tuning (the operator's data path override, the codec kernels) likewise.
        chosen = tuning.from_env(os.environ)
        codec.configure(codec.KernelRequest.of(chosen))
        setting = chosen.data_path
        self.config = replace(self.config, data_path=setting)
        self.transport = make_transport(self.transport_kind, self.extra, self.host, self.kv.device, setting)
        if self.identity.sends:
            peers = DecodePeers(self.extra.decode_host, self.extra.decode_port, self.host)
            self.sender = KVSender(
                self.transport, self.kv, self.config, peer_address=peers.address, auth=auth
            )
        if self.identity.receives:
            port = self.identity.kv_port + self.identity.tp_rank
            prefill_tp = self.extra.peer_tp_size or self.identity.tp_size
            self.receiver = KVReceiver(
                self.transport,
                self.kv,
                self.config,
                self.host,
                port,
                engine_id=self.identity.engine_id,
                auth=auth,
                max_connections=connections_for(self.identity.max_num_seqs, prefill_tp),
            )
        side = self.sender or self.receiver
        # Where payloads are encoded is known now: off the host path, on the cache's device (in device
        # staging, or in the scratch the pinned-host path copies from). The kernels and the checksum
        # are compiled and checked for it here, not at the first transfer (seconds, past a peer's
        # timeout); a device whose kernels write other bytes than the host's stops the engine here.
        off_host = side is not None and side.placement.path is not DataPath.HOST
        staging = self.kv.device if off_host and self.kv.device.type != "cpu" else None
        codec.warm_up(self.kv.gather([0]), self.config.compression, self.kv.layout.groups, staging=staging)
        if staging is not None:
            span_checksum.warm_up(self.kv)  # the zero-copy checksum, where the data path may take it
        if side is not None:
            self.data_path = side.placement.path.value
            self.data_path_reason = side.data_path
            _log.info(
                "KV data path (TP rank %d, %s): %s",
                self.identity.tp_rank,
                self.transport.traits().kind,
                side.data_path,
            )

    def start(self, plan: StepPlan) -> None:
        """Start the step's loads, cancels and sends. Never raises on what a request asked for (C1):
        a load or send this worker cannot do is reported failed through `results()`."""
        for load in plan.loads:
            if self.receiver is None:
                self._refused[load.request_id] = (load.block_ids, "this engine does not receive KV")
                continue
            if load.transfer_id in self._loads:
                self._refused[load.request_id] = (
                    load.block_ids,
                    f"transfer id {load.transfer_id} is already in use",
                )
                continue
            try:
                self.receiver.expect(
                    load.transfer_id,
                    load.block_ids,
                    skip=load.skip,
                    prompt_hash=load.prompt_hash,
                    prefill_tp_size=load.prefill_tp_size,
                )
            except Exception as error:  # noqa: BLE001 - a request's load never stops the engine step (C1)
                expected = isinstance(error, (TransferFailed, LayoutError))
                if not expected:
                    _log.warning("KV load of request %s refused", load.request_id, exc_info=True)
                self._refused[load.request_id] = (load.block_ids, str(error)[:200])
                continue
            self._loads[load.transfer_id] = (load.request_id, load.block_ids)
        for transfer_id in plan.cancels:
            if self.receiver is not None and transfer_id in self._loads:
                self._cancelled.add(transfer_id)
                self.receiver.cancel(transfer_id)
        for send in plan.sends:
            self._sends[send.transfer_id] = send.request_id
            if self.sender is None:
                self._unsendable[send.transfer_id] = "this engine does not send KV"
                continue
            job = SendJob(
                send.transfer_id,
                send.block_ids,
                send.host,
                send.port,  # decode rank r listens on port + r
                send.prompt_hash,
                send.engine_id,
                send.decode_tp_size,
            )
            self.sender.submit(job)

    def _record_failure(self, transfer_id: str, reason: str) -> None:
        self.failures[transfer_id] = reason
        while len(self.failures) > 1000:
            del self.failures[next(iter(self.failures))]

    def results(self) -> StepResults:
        sending: set[str] = set()
        for transfer_id, reason in self._sender_done().items():
            if reason:
                self._record_failure(transfer_id, reason)
            if transfer_id in self._sends:
                sending.add(self._sends.pop(transfer_id))
        recving: set[str] = set()
        failed: set[str] = set()
        for request_id, (blocks, reason) in self._refused.items():
            recving.add(request_id)
            failed.add(request_id)
            self._load_errors.update(blocks)
            _log.warning("KV for request %s not loaded: %s", request_id, reason)
        self._refused.clear()
        for transfer_id, outcome in self._receiver_done().items():
            if transfer_id not in self._loads:
                continue
            request_id, blocks = self._loads.pop(transfer_id)
            recving.add(request_id)
            if transfer_id in self._cancelled:
                # vLLM aborted it and frees its blocks once this reports it ended (H5): they held
                # no load another request could use, so none are reported as load errors
                self._cancelled.discard(transfer_id)
                continue
            if outcome:
                self._record_failure(transfer_id, outcome)
                failed.add(request_id)
                self._load_errors.update(blocks)
                _log.warning(
                    "KV for request %s (transfer %s) not loaded: %s", request_id, transfer_id, outcome
                )
        return StepResults(sending, recving, failed)

    def _sender_done(self) -> dict[str, str | None]:
        done: dict[str, str | None] = dict(self._unsendable)
        self._unsendable.clear()
        return done | (self.sender.finished() if self.sender is not None else {})

    def _receiver_done(self) -> dict[str, str]:
        return self.receiver.results() if self.receiver is not None else {}

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def data_path_levels(self) -> dict[str, str]:
        """The path in use and why, for the connector's metrics (empty before the caches came)."""
        if self.data_path is None or self.transport is None:
            return {}
        return {
            "data_path": self.data_path,
            "data_path_transport": self.transport.traits().kind,
            "data_path_reason": self.data_path_reason,
        }

    def stats(self) -> dict[str, float]:
        """The pipes' counters summed, and the seconds spent in the codec (codec_seconds)."""
        totals: dict[str, float] = {}
        for pipe in (self.sender, self.receiver):
            if pipe is not None:
                for key, value in pipe.stats.snapshot().items():
                    totals[key] = totals.get(key, 0) + value
                totals["codec_seconds"] = totals.get("codec_seconds", 0.0) + pipe.codec_time.total
        return totals

    def take_durations(self) -> list[float]:
        """Seconds of each transfer that ended with the KV in place since the last call."""
        return [
            seconds
            for pipe in (self.sender, self.receiver)
            if pipe is not None
            for seconds in pipe.durations.take()
        ]

    def take_queued(self) -> list[float]:
        """Seconds each send waited for its connection, since the last call (prefill only)."""
        return self.sender.queued.take() if self.sender is not None else []

    def close(self) -> None:
        sends_ended = self.sender.close() if self.sender is not None else True
        loads_ended = self.receiver.close() if self.receiver is not None else True
        if self.transport is not None and sends_ended and loads_ended:  # else one may still write (M4)
            self.transport.close()
