"""Mooncake transfer engine transport: one-sided batch writes into the peer's registered memory.

P2PHANDSHAKE metadata (no metadata server), RDMA or TCP. Memory is registered once per tensor and
reused; the RPC port is drawn from a configured range (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar

import torch

from dllm_connector.transport.base import (
    Source,
    Span,
    TransferTimeout,
    Transport,
    TransportError,
    check_sizes,
    span_of,
)

# Entries per batch call: bounds one call's duration and its argument lists.
_BATCH = 1024


def configure_environment(
    *, bind_host: str | None, rpc_ports: tuple[int, int] | None, timeout_s: float | None
) -> None:
    """Mooncake reads its knobs from the environment at initialize; set ours before that."""
    if bind_host:
        os.environ["MC_TCP_BIND_ADDRESS"] = bind_host
    if rpc_ports is not None:
        low, high = rpc_ports
        if not 1024 <= low <= high <= 65535:
            raise TransportError(f"RPC port range {low}-{high} must lie within 1024-65535")
        os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(low), str(high)
    if timeout_s is not None:
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, round(timeout_s))))


class MooncakeTransport(Transport):
    name: ClassVar[str] = "mooncake"
    one_sided: ClassVar[bool] = True

    def __init__(
        self,
        host: str,
        *,
        protocol: str = "tcp",
        devices: Sequence[str] = (),
        rpc_ports: tuple[int, int] | None = None,
    ) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise TransportError(f"the Mooncake transfer engine is not importable: {error}") from None
        configure_environment(bind_host=host, rpc_ports=rpc_ports, timeout_s=None)
        if protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        self._engine = TransferEngine()
        status = self._engine.initialize(host, "P2PHANDSHAKE", protocol, ",".join(devices))
        if status != 0:
            raise TransportError(f"Mooncake initialize({host}, P2PHANDSHAKE, {protocol}) returned {status}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, tensor: torch.Tensor) -> None:
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            if self._registered.get(addr, -1) >= nbytes:
                return
            if addr in self._registered:
                self._engine.unregister_memory(addr)
            if self._engine.register_memory(addr, nbytes) != 0:
                raise TransportError(f"Mooncake could not register {nbytes} bytes at {addr:#x}")
            self._registered[addr] = nbytes

    def unregister(self, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._registered.pop(tensor.data_ptr(), None) is not None:
                self._engine.unregister_memory(tensor.data_ptr())

    def endpoint(self) -> dict[str, Any]:
        return {"session": self._session}

    def send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
    ) -> None:
        check_sizes(src, dst)
        session = str(peer["session"])
        done: Future[None] = Future()
        worker = threading.Thread(
            target=self._write_batches, args=(session, src, dst, done), name="mooncake-write", daemon=True
        )
        worker.start()
        try:
            done.result(timeout=timeout)
        except TimeoutError:
            raise TransferTimeout(f"Mooncake write to {session} ran past {timeout:.1f}s") from None

    def _write_batches(
        self, session: str, src: Sequence[Source], dst: Sequence[Span], done: Future[None]
    ) -> None:
        try:
            for start in range(0, len(src), _BATCH):
                local = [span_of(source).addr for source in src[start : start + _BATCH]]
                remote = [region.addr for region in dst[start : start + _BATCH]]
                lengths = [region.nbytes for region in dst[start : start + _BATCH]]
                status = self._engine.batch_transfer_sync_write(session, local, remote, lengths)
                if status != 0:
                    raise TransportError(f"Mooncake batch write to {session} failed (status {status})")
            done.set_result(None)
        except Exception as error:  # noqa: BLE001 - handed to the waiting caller
            done.set_exception(error)

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        return None

    def close(self) -> None:
        with self._lock:
            for addr in list(self._registered):
                self._engine.unregister_memory(addr)
            self._registered.clear()
