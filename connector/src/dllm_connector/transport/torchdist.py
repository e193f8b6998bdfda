"""NCCL (GPU) or gloo (CPU) transport through torch.distributed, on a stateless group per peer pair.

The vLLM worker owns the default process group, so each (sender, receiver) pair gets its own
two-rank group, made lazily at its first transfer: the sender hosts a TCPStore (rank 0), the
receiver joins it (rank 1). A failed transfer drops the pair's group; the next one builds a new
generation. Send and receive are two-sided: sizes come from the side-channel handshake.

Trust (security review M7). The TCPStore itself has no authentication; what protects a pair is that
the receiver joins only a store its sender named over the (authenticated, see sidechannel) side
channel, on the address that side channel's peer connects from: `admit(endpoint, peer_host)` checks
the offer and records it, and with `require_admission` the receiver joins no other store. Each
process keeps at most `max_groups` pair groups (least recently used first out; an NCCL communicator
holds GPU memory); a dropped group's key is refused at once after that, so its sender starts a new
generation rather than waiting for a rendezvous that never comes. The store, gloo and NCCL listen on
ephemeral ports: the engines' NetworkPolicy has to admit any port between them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import threading
import uuid
from collections import OrderedDict
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
from dllm_connector.transport.placement import TransportTraits
from dllm_connector.transport.sidechannel import clip

_SENDER, _RECEIVER = 0, 1
MAX_GROUPS = 64
# Pair keys are `<12 hex>-<peer node>-<generation>`: anything much longer did not come from us.
_MAX_PAIR_CHARS = 300
_RETIRED_KEPT = 1024
# NCCL's watchdog acts on a group's own timeout and, by default, tears the whole process down: a peer
# that stalls past it would take the engine with it (gpu-review item 3). A group gets this long; a
# transfer's own timeout is enforced here, and the group of a transfer that fails is aborted.
WATCHDOG_TIMEOUT = timedelta(minutes=10)
# Stores and backend classes are real but untyped in torch's stubs.
_c10d: Any = dist


class TorchDistTransport(Transport):
    name: ClassVar[str] = "torch.distributed"
    one_sided: ClassVar[bool] = False

    def __init__(
        self,
        host: str,
        *,
        backend: str = "gloo",
        connect_timeout: float = 30.0,
        max_groups: int = MAX_GROUPS,
        require_admission: bool = False,
    ) -> None:
        if max_groups < 1:
            raise TransportError("max_groups must be at least 1")
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
        self._max_groups = max_groups
        self._require_admission = require_admission
        self._groups: OrderedDict[str, Any] = OrderedDict()  # pair key -> group, least recent first
        self._pairs: OrderedDict[str, str] = OrderedDict()  # sender side: peer node -> current pair key
        self._admitted: OrderedDict[str, tuple[str, int]] = OrderedDict()  # receiver: pair -> its store
        self._retired: OrderedDict[str, None] = OrderedDict()  # pair keys whose group was dropped
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return self._backend

    def traits(self) -> TransportTraits:
        """NCCL sends device tensors (device staging); gloo sends host tensors (host staging)."""
        kind = f"torch.distributed ({self._backend})"
        if self._backend == "nccl":
            return TransportTraits(kind, False, True, moves_host_memory=False)
        return TransportTraits(kind, False, False, "gloo sends host tensors")

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
                while len(self._pairs) > self._max_groups:
                    self._pairs.popitem(last=False)
            self._pairs.move_to_end(peer_node)
            return self._pairs[peer_node]

    def admit(self, endpoint: Mapping[str, Any], peer_host: str) -> None:
        """Receiver: accept the store an offer names, which must be on `peer_host`, the address its
        (authenticated) side channel came from; raises TransportError otherwise (M7)."""
        pair = endpoint.get("pair")
        if not isinstance(pair, str) or not 0 < len(pair) <= _MAX_PAIR_CHARS:
            raise TransportError("the offer names no valid pair key")
        address = store_address(endpoint, peer_host)
        with self._lock:
            self._admitted[pair] = address
            self._admitted.move_to_end(pair)
            while len(self._admitted) > 4 * self._max_groups:
                self._admitted.popitem(last=False)

    @property
    def group_count(self) -> int:
        with self._lock:
            return len(self._groups)

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
        with _on_device_of(tensors):
            self._run(group, [group.send([tensor], _RECEIVER, tag) for tensor in tensors], peer, timeout)

    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        group = self._group(str(peer["pair"]), _RECEIVER, peer, timeout)
        with _on_device_of(dst):
            self._run(group, [group.recv([tensor], _SENDER, tag) for tensor in dst], peer, timeout)

    def _run(self, group: Any, works: list[Any], peer: Mapping[str, Any], timeout: float) -> None:
        try:
            for work in works:
                work.wait(timedelta(seconds=timeout))
        except RuntimeError as error:
            self.forget_peer(peer)
            with contextlib.suppress(Exception):  # its pending operations end; the process goes on
                group.abort()
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise TransferTimeout(f"{self._backend} transfer ran past {timeout:.1f}s") from None
            raise TransportError(f"{self._backend} transfer failed: {error}") from None

    def _group(self, pair: str, rank: int, peer: Mapping[str, Any], timeout: float) -> Any:
        with self._lock:
            group = self._groups.get(pair)
            if group is not None:
                self._groups.move_to_end(pair)
                return group
            if pair in self._retired:
                raise TransportError(f"pair group {clip(pair)} was dropped (at most {self._max_groups} kept)")
            admitted = self._admitted.get(pair)
        if rank == _RECEIVER and admitted is None and self._require_admission:
            raise TransportError(f"pair group {clip(pair)}: no store was admitted for it")
        try:
            group = self._new_group(pair, rank, peer, timeout, admitted)
        except RuntimeError as error:
            raise TransportError(
                f"could not form the {self._backend} pair group {clip(pair)}: {error}"
            ) from None
        with self._lock:
            self._groups[pair] = group
            while len(self._groups) > self._max_groups:
                self._retire_locked(self._groups.popitem(last=False)[0])
        return group

    def _retire_locked(self, pair: str) -> None:
        """Forget a dropped group: its key is refused from now on; the sender's next offer is new."""
        self._retired[pair] = None
        while len(self._retired) > _RETIRED_KEPT:
            self._retired.popitem(last=False)
        self._admitted.pop(pair, None)
        for node, key in list(self._pairs.items()):
            if key == pair:
                del self._pairs[node]

    def _new_group(
        self, pair: str, rank: int, peer: Mapping[str, Any], timeout: float, admitted: tuple[str, int] | None
    ) -> Any:
        wait = timedelta(seconds=timeout)
        if rank == _SENDER:
            self.endpoint()
            assert self._store is not None
            store = self._store
        else:
            host, port = admitted or _split_store(str(peer.get("store")))
            store = _c10d.TCPStore(host, port, None, False, wait)
        prefixed = _c10d.PrefixStore(f"dllm-kv/{pair}", store)
        if self._backend == "nccl":
            options = _c10d.ProcessGroupNCCL.Options()
            options._timeout = max(wait, WATCHDOG_TIMEOUT)
            return _c10d.ProcessGroupNCCL(prefixed, rank, 2, options)
        options = _c10d.ProcessGroupGloo._Options()
        options._timeout = wait
        options._devices = [_c10d.ProcessGroupGloo.create_device(hostname=self._host)]
        return _c10d.ProcessGroupGloo(prefixed, rank, 2, options)

    def forget_peer(self, peer: Mapping[str, Any]) -> None:
        pair = str(peer.get("pair"))
        with self._lock:
            self._groups.pop(pair, None)
            self._admitted.pop(pair, None)
            for node, key in list(self._pairs.items()):
                if key == pair:
                    del self._pairs[node]

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
            self._admitted.clear()
            self._store = None


def _on_device_of(tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """NCCL runs on the current CUDA device: make it the tensors' (a TP rank's GPU is not cuda:0,
    and the writer's thread starts on cuda:0). Host tensors (gloo) need nothing."""
    if tensors and tensors[0].device.type == "cuda":
        return torch.cuda.device(tensors[0].device)
    return contextlib.nullcontext()


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(text.strip("[]"))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # an IPv4 peer seen through a dual-stack socket
    return address


def _split_store(store: str) -> tuple[str, int]:
    host, _, port = store.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise TransportError(f"TCPStore address {clip(store)} is not HOST:PORT")
    return host.strip("[]"), int(port)


def store_address(endpoint: Mapping[str, Any], peer_host: str) -> tuple[str, int]:
    """The TCPStore an offer names, as (ip, port); it must be on the side-channel peer's address."""
    store = endpoint.get("store")
    if not isinstance(store, str) or len(store) > 64:
        raise TransportError(f"the offer names no TCPStore address: {clip(store)}")
    host, port = _split_store(store)
    try:
        named, peer = _ip(host), _ip(peer_host)
    except ValueError:
        raise TransportError(f"TCPStore address {clip(store)} is not an IP address and port") from None
    if named != peer:
        raise TransportError(
            f"the offer's TCPStore {clip(store)} is not on its side-channel peer {peer_host}"
        )
    return str(named), port
