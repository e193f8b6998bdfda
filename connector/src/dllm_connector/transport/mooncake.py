"""Mooncake transfer engine transport: one-sided batch writes into the peer's registered memory.

P2PHANDSHAKE metadata (no metadata server), RDMA or TCP. Memory is registered once per tensor and
reused.

Ports (security review C2; checked on mooncake-transfer-engine 0.3.13.post1 with `ss -ltnp`). Each
engine listens on two TCP ports: the P2P handshake (RPC) port, on 0.0.0.0, and with protocol tcp the
TCP transport's data port, on [::] (dual stack). Both are drawn at random from
MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (default 15000-17000), which `rpc_ports` (DLLM_KV_TRANSFER_PORTS)
sets. Neither can be bound to one address: MC_TCP_BIND_ADDRESS only names the address advertised to
peers, so a NetworkPolicy is the only fence (and with hostNetwork the ports are open on every address of
the node). Mooncake reads the range once per process and silently falls back to 15000-17000 for a range
that reaches below 1024 or into 32768-60999, so the range is checked before and the RPC port after.
Outgoing connections use ephemeral ports. The data port refuses reads and writes outside registered
buffers ("not within any registered buffer"), so a peer that reaches it can read and write the KV
cache and staging buffers, not other memory.

Timeouts (H5). A Mooncake batch write ends by MC_TRANSFER_TIMEOUT (at least 5 s; Mooncake raises lower
values to 5) plus one second per GB, read when the engine is created. `send` raises TransferTimeout
only after the write it started has returned, so a caller never frees or reuses memory under a running
write; with a Python timeout under 5 s that can take up to Mooncake's bound. What remains: bytes
Mooncake already handed to the kernel cannot be recalled, so a peer that stalls past the timeout (and
resumes) still applies them after both sides gave up (seen with a SIGSTOPped peer). A batch that fails
is written once more if the caller's deadline has not passed: the node tier saw a whole node stand still
for 30 s during a roll, past Mooncake's bound, and the transfer then failed with time left to finish.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dllm_connector.thread_device import on_callers_device
from dllm_connector.transport.base import (
    Source,
    Span,
    TransferTimeout,
    Transport,
    TransportError,
    check_sizes,
    columns,
)
from dllm_connector.transport.entry_budget import EntryBudget
from dllm_connector.transport.placement import TransportTraits
from dllm_contract.kvconfig import transfer_ports_problem

_log = logging.getLogger(__name__)

# Entries per batch call: bounds one call's duration and its argument lists.
_BATCH = 1024
# Mooncake's sync writes: MC_TRANSFER_TIMEOUT seconds (at least 5, 30 when unset) plus 1 ns per byte.
MC_MIN_TIMEOUT_S = 5
MC_DEFAULT_TIMEOUT_S = 30
_BYTES_PER_S = 1e9
# Past Mooncake's own bound, the status polling and the thread handing back the result.
_SLACK_S = 2.0
# Threads kept for the writes (a thread started per write cost more than the write of a piece on
# RDMA: docs/benchmarks.md). More writes at once wait their turn, as they would for room in flight
# (EntryBudget); a write that stalls holds its thread only until Mooncake's own timeout ends it.
_WRITERS = 16
# Writes of one transfer on the wire at once over RDMA, where each call's fixed cost (its batch's
# setup and completion polling) is what the others' bytes cover (gpu-review item 12); not measured
# (no RDMA here). Over TCP one at a time: four at once measured slower on 127.0.0.1 (docs/benchmarks.md).
RDMA_WRITES_IN_FLIGHT = 4


def mooncake_timeout_s(env: Mapping[str, str]) -> int:
    """The timeout Mooncake applies for MC_TRANSFER_TIMEOUT in `env` (atoi, then at least 5)."""
    raw = env.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return MC_DEFAULT_TIMEOUT_S
    number = re.match(r"\s*([+-]?\d+)", raw)
    return max(MC_MIN_TIMEOUT_S, int(number.group(1)) if number else 0)


def configure_environment(
    *, bind_host: str | None, rpc_ports: tuple[int, int] | None, timeout_s: float | None
) -> None:
    """Mooncake reads its knobs from the environment at initialize; set ours before that.

    `timeout_s`: the caller's timeout for one write; Mooncake's is set no longer (but at least 5 s).
    Without one, Mooncake's 30 s default is lowered to its minimum.
    """
    if bind_host:
        os.environ["MC_TCP_BIND_ADDRESS"] = bind_host
    if rpc_ports is not None:
        low, high = rpc_ports
        if problem := transfer_ports_problem(low, high):
            raise TransportError(f"Mooncake port range {low}-{high} {problem}")
        os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(low), str(high)
    if timeout_s is not None:
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(MC_MIN_TIMEOUT_S, int(timeout_s)))
    else:
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(MC_MIN_TIMEOUT_S))


# Mooncake's wheels: `mooncake-transfer-engine` (and -cuda13) are built with CUDA and take device
# pointers (GPUDirect RDMA where the NIC and driver allow it); `...-non-cuda` takes host memory only.
_NON_CUDA_DIST = "mooncake-transfer-engine-non-cuda"


def cuda_build(distributions: Iterable[str]) -> bool:
    """Whether the Mooncake installed (the distributions providing `mooncake`) is a CUDA build."""
    names = {name.lower().replace("_", "-") for name in distributions}
    return any(name.startswith("mooncake-transfer-engine") and name != _NON_CUDA_DIST for name in names)


def installed_cuda_build() -> bool:
    return cuda_build(importlib.metadata.packages_distributions().get("mooncake", []))


# The device path over TCP, for a check on one GPU (two engines, one device: no RDMA NIC between
# them, and NCCL needs two GPUs); slower than pinned-host staging, as below (gpu-review item 17).
TCP_DEVICE_ENV = "DLLM_KV_TCP_DEVICE"


def mooncake_traits(protocol: str, *, cuda_build: bool, tcp_device: bool = False) -> TransportTraits:
    """Device memory is worth registering only where the NIC reads it (RDMA, GPUDirect). Over TCP,
    Mooncake's CUDA build copies device memory through a host buffer of its own, 64 KiB at a time,
    synchronously and on the default stream: pinned staging, its copies overlapped with the wire, is
    faster there, unless `tcp_device` (TCP_DEVICE_ENV=1) asks for the device path anyway."""
    kind = f"mooncake ({protocol})"
    if not cuda_build:
        return TransportTraits(kind, True, False, f"{_NON_CUDA_DIST} is installed, a build without CUDA")
    if protocol != "rdma" and tcp_device:
        return TransportTraits(f"{kind}, device memory copied by Mooncake ({TCP_DEVICE_ENV}=1)", True, True)
    if protocol != "rdma":
        why = "over TCP Mooncake copies device memory through host buffers itself, unoverlapped"
        return TransportTraits(kind, True, False, why)
    return TransportTraits(kind, True, True)


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
        timeout_s: float | None = None,
    ) -> None:
        """`rpc_ports`: DLLM_KV_TRANSFER_PORTS (both listening ports); `timeout_s`: transfer_timeout_ms."""
        # Before the import: loading Mooncake's library already reads its global config (the ports).
        configure_environment(bind_host=host, rpc_ports=rpc_ports, timeout_s=timeout_s)
        if protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise TransportError(f"the Mooncake transfer engine is not importable: {error}") from None
        self._call_timeout_s = mooncake_timeout_s(os.environ)
        self._engine = TransferEngine()
        status = self._engine.initialize(host, "P2PHANDSHAKE", protocol, ",".join(devices))
        if status != 0:
            raise TransportError(f"Mooncake initialize({host}, P2PHANDSHAKE, {protocol}) returned {status}")
        rpc_port = int(self._engine.get_rpc_port())
        if rpc_ports is not None and not rpc_ports[0] <= rpc_port <= rpc_ports[1]:
            raise TransportError(
                f"Mooncake listens on port {rpc_port}, outside {rpc_ports[0]}-{rpc_ports[1]}: it reads "
                "its port range once per process, and this process's Mooncake started with another"
            )
        self._session = f"{host}:{rpc_port}"
        self._protocol = protocol
        self._cuda = installed_cuda_build()
        self._tcp_device = os.environ.get(TCP_DEVICE_ENV, "") == "1"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self.entries = EntryBudget()  # shared by every write through this engine
        self.writes_in_flight = RDMA_WRITES_IN_FLIGHT if protocol == "rdma" else 1
        # as many transfers at once whatever each keeps in flight
        self._writers = ThreadPoolExecutor(
            _WRITERS * self.writes_in_flight, thread_name_prefix="mooncake-write"
        )

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

    def traits(self) -> TransportTraits:
        return mooncake_traits(self._protocol, cuda_build=self._cuda, tcp_device=self._tcp_device)

    def send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
    ) -> None:
        self.begin_send(peer, src, dst, tag, timeout)()

    def begin_send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> Callable[[], None]:
        """The write goes to one of the transport's threads; what this returns waits for it, up to
        `timeout` from now. No batch starts, and none is written again, past that deadline or once
        `stop` is set, whoever waits for it."""
        check_sizes(src, dst)
        session = str(peer["session"])
        stop = threading.Event() if stop is None else stop
        deadline = time.monotonic() + timeout
        # Mooncake may read device memory: the write runs on the caller's device.
        try:
            done = self._writers.submit(
                on_callers_device(self._write_batches), session, src, dst, stop, deadline
            )
        except RuntimeError:  # shut down: close() ran
            raise _closed(session) from None
        return functools.partial(self._finish, done, _Write(session, stop, deadline, timeout, dst))

    def _finish(self, done: Future[None], write: _Write) -> None:
        session = write.session
        try:
            done.result(timeout=max(0.0, write.deadline - time.monotonic()))
            return
        except TimeoutError:
            write.stop.set()  # no further batch starts
        except CancelledError:  # close() cancelled it before a thread took it
            raise _closed(session) from None
        if done.cancel():  # still waiting for a thread: it never touches the memory now
            waited = f"waited past {write.timeout:.1f}s for a thread"
            raise TransferTimeout(f"Mooncake write to {session} {waited}")
        # The batch in flight still reads our memory and writes the peer's until Mooncake gives up:
        # return only after it did, so no caller frees or reuses that memory under it (H5).
        try:
            done.result(timeout=self.call_bound_s(write.dst))
        except TimeoutError:
            _log.error("Mooncake write to %s still runs past Mooncake's own timeout", session)
        except (TransportError, CancelledError):
            pass
        else:
            return  # it finished after all, late
        raise TransferTimeout(f"Mooncake write to {session} ran past {write.timeout:.1f}s")

    def call_bound_s(self, dst: Sequence[Span]) -> float:
        """How long one batch call of these destinations can run before Mooncake ends it itself."""
        lengths = columns(dst)[1]
        batches = range(0, len(lengths), _BATCH)
        largest = max((sum(lengths[i : i + _BATCH]) for i in batches), default=0)
        return self._call_timeout_s + largest / _BYTES_PER_S + _SLACK_S

    def _write_batches(
        self,
        session: str,
        src: Sequence[Source],
        dst: Sequence[Span],
        stop: threading.Event,
        deadline: float,
    ) -> None:
        """The batches of one send, one after another (raises into the caller's future)."""
        sources, (targets, sizes) = columns(src)[0], columns(dst)
        for start in range(0, len(sources), _BATCH):
            # also a send that waited for a thread past its caller's wait, or one among several
            # under way whose caller stopped at another's failure
            if stop.is_set() or time.monotonic() >= deadline:
                raise TransferTimeout(f"Mooncake write to {session} stopped at its deadline")
            local = sources[start : start + _BATCH]
            remote = targets[start : start + _BATCH]
            lengths = sizes[start : start + _BATCH]
            if not self.entries.acquire(len(lengths), deadline):
                raise TransferTimeout(f"Mooncake write to {session} found no room in flight by its deadline")
            try:
                status = self._write(session, local, remote, lengths, stop, deadline)
            finally:
                self.entries.release(len(lengths))
            if status != 0:
                raise TransportError(f"Mooncake batch write to {session} failed (status {status})")

    def _write(
        self,
        session: str,
        local: list[int],
        remote: list[int],
        lengths: list[int],
        stop: threading.Event,
        deadline: float,
    ) -> int:
        status = int(self._engine.batch_transfer_sync_write(session, local, remote, lengths))
        if status != 0 and not stop.is_set() and time.monotonic() < deadline:
            # Once more while the caller's deadline allows: a peer (or a whole node) that stood still
            # past Mooncake's own bound, then resumed, takes the same bytes now; writing them again to
            # the same place changes nothing if the first write did land.
            _log.warning("Mooncake batch write to %s failed (status %s); again", session, status)
            status = int(self._engine.batch_transfer_sync_write(session, local, remote, lengths))
        return status

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        return None

    def close(self) -> None:
        self._writers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for addr in list(self._registered):
                self._engine.unregister_memory(addr)
            self._registered.clear()


@dataclass(frozen=True)
class _Write:
    """A write under way, as its waiter needs it."""

    session: str
    stop: threading.Event
    deadline: float  # monotonic
    timeout: float
    dst: Sequence[Span]


def _closed(session: str) -> TransportError:
    return TransportError(f"Mooncake write to {session} not made: the transport closed")
