"""The one small interface every KV transport implements, and its errors."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, overload

import torch

from dllm_connector.transport.placement import TransportTraits


class TransportError(RuntimeError):
    """A transfer did not complete: the peer is unreachable, refused it, or it broke midway."""


class TransferTimeout(TransportError):
    """A transfer, or a wait for the peer, ran past its deadline."""


@dataclass(frozen=True)
class Span:
    """A span of registered memory by address: the peer's, as it announced it, or ours."""

    addr: int
    nbytes: int

    def to_list(self) -> list[int]:
        return [self.addr, self.nbytes]


class SpanList(Sequence[Span]):
    """Spans as two columns, addresses and lengths, made without an object per span (a zero-copy
    piece's block writes, layout.span_table): one-sided transports read the columns; anything else
    sees Span objects, made on access."""

    __slots__ = ("addrs", "lengths")

    def __init__(self, addrs: list[int], lengths: list[int]) -> None:
        if len(addrs) != len(lengths):
            raise ValueError(f"{len(addrs)} span addresses with {len(lengths)} lengths")
        self.addrs, self.lengths = addrs, lengths

    def __len__(self) -> int:
        return len(self.addrs)

    @overload
    def __getitem__(self, index: int) -> Span: ...

    @overload
    def __getitem__(self, index: slice) -> SpanList: ...

    def __getitem__(self, index: int | slice) -> Span | SpanList:
        if isinstance(index, slice):
            return SpanList(self.addrs[index], self.lengths[index])
        return Span(self.addrs[index], self.lengths[index])


# Local sources: tensors (any transport) or spans of registered memory (one-sided transports).
Source = torch.Tensor | Span


def columns(regions: Sequence[Source]) -> tuple[list[int], list[int]]:
    """(addresses, lengths) of some regions: a SpanList's own columns, else one region at a time."""
    if isinstance(regions, SpanList):
        return regions.addrs, regions.lengths
    spans = [span_of(region) for region in regions]
    return [span.addr for span in spans], [span.nbytes for span in spans]


def span_of(source: Source) -> Span:
    if isinstance(source, Span):
        return source
    return Span(source.data_ptr(), source.numel() * source.element_size())


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    if not tensor.is_contiguous():
        raise TransportError("transport regions must be contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


class Transport(ABC):
    """Moves bytes from local tensors to a peer.

    One-sided transports (Mooncake) write straight into `dst`, the peer's announced regions, and the
    peer posts nothing; their sources may be Spans of registered memory. Two-sided ones (NCCL, gloo)
    need tensor sources and the peer to call `recv` with matching sizes and the same tag; `dst` then
    only carries the sizes.
    """

    name: ClassVar[str]
    one_sided: ClassVar[bool]
    # Writes of one transfer a caller may keep under way at once (`begin_send`).
    writes_in_flight: int = 1

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> None:
        """Make a tensor's memory transferable; registering the same memory again is a no-op."""

    @abstractmethod
    def unregister(self, tensor: torch.Tensor) -> None:
        """Undo register before the memory is freed."""

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """What a peer needs to reach this side (sent in the side-channel handshake)."""

    @abstractmethod
    def send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
    ) -> None:
        """Deliver each src tensor's bytes to the matching dst region, or raise TransportError."""

    def begin_send(
        self,
        peer: Mapping[str, Any],
        src: Sequence[Source],
        dst: Sequence[Span],
        tag: int,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> Callable[[], None]:
        """Start `send` and return what waits for it to end (raising what `send` would), so that a
        caller can start the next one meanwhile. The caller always waits before it reuses or frees
        the memory. Once `stop` is set the write starts nothing more (its caller gave up: another
        write failed). By default the whole send runs here."""
        self.send(peer, src, dst, tag, timeout)
        return _sent

    @abstractmethod
    def recv(self, peer: Mapping[str, Any], dst: Sequence[torch.Tensor], tag: int, timeout: float) -> None:
        """Two-sided transports: receive into dst; one-sided ones return at once."""

    def traits(self) -> TransportTraits:
        """What the data-path decision needs to know (transport.placement); by default, host only."""
        return TransportTraits(self.name, self.one_sided, False, f"{self.name} moves host memory only")

    def forget_peer(self, peer: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Drop per-peer state after a failure, so the next transfer starts clean."""

    @abstractmethod
    def close(self) -> None:
        """Release registrations and connections."""


def _sent() -> None:
    return None


def check_sizes(src: Sequence[Source], dst: Sequence[Span]) -> None:
    if len(src) != len(dst):
        raise TransportError(f"{len(src)} source regions for {len(dst)} destination regions")
    sizes, wanted = columns(src)[1], columns(dst)[1]
    if sizes == wanted:
        return
    index = next(i for i, (nbytes, peers) in enumerate(zip(sizes, wanted, strict=True)) if nbytes != peers)
    raise TransportError(f"region {index}: {sizes[index]} bytes to send, peer expects {wanted[index]}")
