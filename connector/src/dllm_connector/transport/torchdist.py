"""NCCL (GPU) or gloo (CPU) transport through torch.distributed, on a stateless group per peer pair.

The vLLM worker owns the default process group, so each (sender, receiver) pair gets its own
two-rank group, made lazily at its first transfer: the sender hosts a TCPStore (rank 0), the
receiver joins it (rank 1). A failed transfer drops the pair's group; the next one builds a new
generation. Send and receive are two-sided: sizes come from the side-channel handshake.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dllm_connector.transport.base import (
    Source,
    Span,
    TransferTimeout,
    Transport,
    TransportError,
    check_sizes,
)

_SENDER, _RECEIVER = 0, 1
# Stores and backend classes are real but untyped in torch's stubs.
_c10d: Any = dist


class TorchDistTransport(Transport):
    name: ClassVar[str] = "torch.distributed"
    one_sided: ClassVar[bool] = False

    def __init__(self, host: str, *, backend: str = "gloo", connect_timeout: float = 30.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise TransportError(f"backend {backend!r}: expected gloo or nccl")
        if backend == "nccl" and not dist.is_nccl_available():
            raise TransportError("NCCL is not available in this torch build")
        self._host = host
        self._backend = backend
        self._connect_timeout = connect_timeout
        self._id = uuid.uuid4().hex[:12]
        self._generation = itertools.count()
        self._store: Any = None
        self._groups: dict[str, Any] = {}
        self._pairs: dict[str, str] = {}  # sender side: peer node -> current pair key
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return self._backend

    def register(self, tensor: torch.Tensor) -> None:
        return None

    def unregister(self, tensor: torch.Tensor) -> None:
        return None

    def endpoint(self) -> dict[str, Any]:
        """The sender's store, created on first use; receivers join it."""
        with self._lock:
            if self._store is None:
                timeout = timedelta(seconds=self._connect_timeout)
                self._store = _c10d.TCPStore(self._host, 0, None, True, timeout, wait_for_workers=False)
            return {"store": f"{self._host}:{self._store.port}", "node": self._id}

    def pair_key(self, peer_node: str) -> str:
        """The group key a sender puts in its offer; a new generation after each failure."""
        with self._lock:
            if peer_node not in self._pairs:
                self._pairs[peer_node] = f"{self._id}-{peer_node}-{next(self._generation)}"
            return self._pairs[peer_node]

    def send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
    ) -> None:
        check_sizes(src, dst)
        tensors = [source for source in src if isinstance(source, torch.Tensor)]
        if len(tensors) != len(src):
            raise TransportError(f"{self._backend} sends tensors, not raw memory spans")
        group = self._group(str(peer["pair"]), _SENDER, peer, timeout)
        self._run([group.send([tensor], _RECEIVER, tag) for tensor in tensors], peer, timeout)

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        group = self._group(str(peer["pair"]), _RECEIVER, peer, timeout)
        self._run([group.recv([tensor], _SENDER, tag) for tensor in dst], peer, timeout)

    def _run(self, works: list[Any], peer: Mapping[str, Any], timeout: float) -> None:
        try:
            for work in works:
                work.wait(timedelta(seconds=timeout))
        except RuntimeError as error:
            self.forget_peer(peer)
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise TransferTimeout(f"{self._backend} transfer ran past {timeout:.1f}s") from None
            raise TransportError(f"{self._backend} transfer failed: {error}") from None

    def _group(self, pair: str, rank: int, peer: Mapping[str, Any], timeout: float) -> Any:
        with self._lock:
            group = self._groups.get(pair)
        if group is not None:
            return group
        try:
            group = self._new_group(pair, rank, peer, timeout)
        except RuntimeError as error:
            raise TransportError(f"could not form the {self._backend} pair group {pair}: {error}") from None
        with self._lock:
            self._groups[pair] = group
        return group

    def _new_group(self, pair: str, rank: int, peer: Mapping[str, Any], timeout: float) -> Any:
        wait = timedelta(seconds=timeout)
        if rank == _SENDER:
            self.endpoint()
            assert self._store is not None
            store = self._store
        else:
            host, port = str(peer["store"]).rsplit(":", 1)
            store = _c10d.TCPStore(host, int(port), None, False, wait)
        prefixed = _c10d.PrefixStore(f"dllm-kv/{pair}", store)
        if self._backend == "nccl":
            options = _c10d.ProcessGroupNCCL.Options()
            options._timeout = wait
            return _c10d.ProcessGroupNCCL(prefixed, rank, 2, options)
        options = _c10d.ProcessGroupGloo._Options()
        options._timeout = wait
        options._devices = [_c10d.ProcessGroupGloo.create_device(hostname=self._host)]
        return _c10d.ProcessGroupGloo(prefixed, rank, 2, options)

    def forget_peer(self, peer: Mapping[str, Any]) -> None:
        pair = str(peer.get("pair"))
        with self._lock:
            self._groups.pop(pair, None)
            for node, key in list(self._pairs.items()):
                if key == pair:
                    del self._pairs[node]

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
            self._store = None
