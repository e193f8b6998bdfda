"""What the sender and the receiver share: configuration, counters, errors, chunking, the side base."""

from __future__ import annotations

import contextlib
import select
import socket
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from dllm_connector import codec
from dllm_connector.layout import LayoutError, PagedKV
from dllm_connector.pipe.device_copy import Copies, Scratch
from dllm_connector.pipe.durations import Durations, SecondsTotal
from dllm_connector.pipe.host_parts import PinnedParts
from dllm_connector.pipe.messages import (
    Accept,
    Chunk,
    EndTransfer,
    MalformedMessage,
    Offer,
    Piece,
    SideMessage,
    Slot,
    WireMessage,
    bounded,
    dump,
    parse_any,
)
from dllm_connector.pipe.messages import parse as parse_message
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import Transport, TransportError
from dllm_connector.transport.placement import DataPath, PathSetting, Placement, choose_path
from dllm_connector.transport.sidechannel import Message
from dllm_connector.transport.staging import StagingBuffer
from dllm_contract.kvconfig import Compression, ConnectorExtraConfig

_GB = 1 << 30
# A transfer is pipelined in chunks (transferThresholdTokens of KV each): chunk k+1 is encoded
# while chunk k is on the wire, and decoded on the other side while k+2 arrives. Without a block
# size (the tensor API) chunks hold about this much raw KV.
CHUNK_BYTES = 32 << 20
# A thread waiting on a peer wakes this often to see whether its transfer was cancelled or its
# side is closing (a wait is never one long blocking recv).
POLL_S = 0.05
# Connection attempts to a side channel that is not up yet are retried this often.
CONNECT_RETRY_S = 0.05
# A side channel that answered "full" (NEW-7) is asked again after a pause that doubles from the first
# to the last of these, jittered so that the connections a burst refused do not all come back at once.
FULL_RETRY_S = (0.02, 0.5)
# Errors a transfer expects (their message says it all); any other exception is a bug or a
# malformed peer: it still ends the transfer, and its traceback is logged once.
EXPECTED_ERRORS = (TransportError, codec.CodecError, LayoutError)


def gb(nbytes: int) -> float:
    """`nbytes` in the contract's unit, GB: exact both ways, as GB is a power of two."""
    return nbytes / _GB


@dataclass(frozen=True)
class PipeConfig:
    """The connector's extra config (the contract's model, so its defaults and bounds), read in the
    pipe's units (bytes, seconds), and the two settings only the pipe has."""

    extra: ConnectorExtraConfig = field(default_factory=ConnectorExtraConfig)
    chunk_bytes: int = CHUNK_BYTES  # the batch size where the block size is unknown (tensor API)
    data_path: PathSetting = PathSetting.AUTO  # the operator's override of transport.placement's choice

    def with_extra(self, **changes: Any) -> PipeConfig:
        """This config with these extra config fields changed, validated as the contract validates them."""
        return replace(self, extra=ConnectorExtraConfig.model_validate(self.extra.model_dump() | changes))

    @property
    def compression(self) -> Compression:
        return self.extra.compression

    @property
    def buffer_bytes(self) -> int:
        return int(self.extra.buffer_size_gb * _GB)

    @property
    def transfer_timeout_s(self) -> float:
        return self.extra.transfer_timeout_ms / 1000

    @property
    def prefill_wait_s(self) -> float:
        return self.extra.prefill_wait_ms / 1000

    @property
    def hold_s(self) -> float:
        return float(self.extra.hold_seconds)

    @property
    def async_transfer(self) -> bool:
        return self.extra.async_transfer

    @property
    def threshold_tokens(self) -> int:
        """KV moves in batches of this many tokens."""
        return self.extra.transfer_threshold_tokens


@dataclass
class PipeStats:
    sent: int = 0
    received: int = 0
    failed_sends: int = 0
    failed_receives: int = 0
    timeouts: int = 0
    checksum_failures: int = 0
    stops_requested: int = 0  # senders decode told to stop mid-stream (a cancel or a failed chunk)
    bytes_on_wire: int = 0
    raw_bytes: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


class TransferFailed(TransportError):
    """A transfer ended without the KV in place; the message says why."""


class RefusedWithDetail(TransferFailed):
    """Refused for a reason whose detail stays local: the peer is told `peer_reason` only (L2)."""

    def __init__(self, detail: str, peer_reason: str) -> None:
        super().__init__(detail)
        self.peer_reason = peer_reason


def chunk_ranges(count: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """[start, stop) block ranges of the chunks a transfer is pipelined in (both sides agree)."""
    return [(start, min(start + chunk_blocks, count)) for start in range(0, count, chunk_blocks)]


class PipeSide:
    """What both sides hold: the transport, with a staging buffer and (where the data path lets a
    peer write into it) the paged KV registered once.

    The data path (transport.placement) places the staging: on the KV's device (device), in
    page-locked host memory (pinned-host, with a scratch on the device to encode and decode in),
    or in host memory (host). `data_path` says which and why, in words.
    """

    def __init__(self, transport: Transport, kv: PagedKV, config: PipeConfig) -> None:
        self.transport = transport
        self.kv = kv
        self.config = config
        self.stats = PipeStats()
        self.durations = Durations()  # seconds per transfer that ended with the KV in place
        self.queued = Durations()  # seconds each send waited, from the request's end to its connection
        self.codec_time = SecondsTotal()  # seconds gathering and encoding, or decoding and placing
        self.host_parts = PinnedParts()  # the host override's copies of a device cache's layers
        effective = codec.effective_codec(config.compression, kv.dtype)
        traits = transport.traits()
        self.placement: Placement = choose_path(kv.device.type, effective, traits, config.data_path)
        try:
            self._place()
        except TransportError as error:
            if self.placement.path is not DataPath.DEVICE or config.data_path is not PathSetting.AUTO:
                raise  # an override the operator asked for fails loudly
            # GPUDirect needs the NIC and its driver (peer memory, dma-buf) too, not only a CUDA
            # build: where registering device memory fails, stage in pinned host memory instead.
            fallback = choose_path(kv.device.type, effective, traits, PathSetting.PINNED_HOST)
            why = f"registering {kv.device.type} memory with {traits.kind} failed ({error})"
            self.placement = replace(fallback, reason=f"{why}: pinned host staging")
            self._place()

    def _place(self) -> None:
        """The staging (and the cache where the path lets a peer write it) allocated and registered
        as the placement says; on a failure, nothing stays registered."""
        path, kv = self.placement.path, self.kv
        self.staging = StagingBuffer(
            self.config.buffer_bytes,
            device=kv.device if path is DataPath.DEVICE else None,
            pinned=path is DataPath.PINNED_HOST,
        )
        self.data_path = self.placement.describe() + (f"; {self.staging.note}" if self.staging.note else "")
        self.copies = Copies(kv.device)
        self.scratch = Scratch(self.staging, kv.device) if path is DataPath.PINNED_HOST else None
        try:
            self.transport.register(self.staging.tensor)
            if self.placement.cache_registered:
                kv.register_with(self.transport.register)
        except BaseException:
            with contextlib.suppress(Exception):
                self._unregister()
            raise

    @property
    def checksum_algo(self) -> codec.ChecksumAlgo:
        """Payloads and zero-copy spans are checksummed where they are: XXH3-64 by host cores on the
        host path, nh64 (device_checksum) on the device off it, the same ops on CPU tensors here."""
        if self.placement.path is DataPath.HOST:
            return codec.ChecksumAlgo.XXH3_64
        return codec.ChecksumAlgo.NH64

    def _unregister(self) -> None:
        self.transport.unregister(self.staging.tensor)
        if self.placement.cache_registered:
            for tensor in self.kv.caches:
                self.transport.unregister(tensor)


_M = TypeVar("_M", Accept, Chunk, EndTransfer, Offer, Piece, Slot)


def parse(model: type[_M], message: Message) -> _M:
    """A peer's message as `model`; TransportError (the transfer ends) when it does not fit."""
    try:
        return parse_message(model, message)
    except MalformedMessage as error:
        raise TransportError(str(error)) from None


def parse_side(message: Message) -> SideMessage:
    """A peer's message as whichever model its type names; TransportError when it fits none."""
    try:
        return parse_any(message)
    except MalformedMessage as error:
        raise TransportError(str(error)) from None


def send(sock: socket.socket, message: WireMessage) -> None:
    """`message` on the side channel (TransportError if the connection broke)."""
    sidechannel.send_message(sock, dump(message))


def quoted(message: Message) -> Message:
    """What of a peer's message an error may repeat: its type and reason, bounded (L2)."""
    return {"type": bounded(message["type"], 20), "reason": bounded(message.get("reason", message["type"]))}


def readable(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer sent something (or closed) within `timeout` seconds."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(max(0, int(timeout * 1000))))
