"""The CUDA device and streams a connector thread works on (gpu-review items 2 and 13).

A new thread starts with cuda:0 current, whatever the thread that made it had: its first CUDA call (an
event's wait, a copy, Mooncake reading device memory) would open a context on GPU 0, on every TP rank.
Each connector thread therefore makes a device current before its work: the KV's, where the code knows
it (`on_device`), else the one current where the thread was made (`on_callers_device`).

A new thread's current stream is also the legacy default stream: transfers running at once would queue
behind one another, and a host read of one (a checksum's value) would wait for all. A thread doing a
transfer's device work (`on_device`) therefore holds two streams of its own while it runs: its main
stream, current for the work, and a side stream for staging copies (`side_stream`). They are made here
with cudaStreamCreate, not taken from torch's pool: vLLM's forward stream and NCCL's streams come from
that pool of 32, which hands the same streams out again in turn, so a pool stream could be vLLM's own.
Streams are kept for reuse (as many pairs as threads ever worked at once), never shared by two threads
at a time. Being ordinary (blocking) streams, they run after work already queued on the legacy default
stream, where Mooncake's TCP build copies into device memory; vLLM's and NCCL's non-blocking streams are
not ordered against them.

Nothing a transfer queues is ordered after vLLM's kernels: the blocks it reads or writes are its own
(prefill sends a request's blocks once vLLM saw its last token; decode's blocks are not read until the
load is reported), and the transfer fences its work on the host before it reports (`settle`) and before
it hands staging on. Both streams are drained before the thread gives them back.

Off CUDA (and where torch is not installed, or nothing initialised CUDA) these leave the work as it is.
torch is imported on use: the side channel runs without it (the connector's wheel without extras).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Streams:
    """A connector thread's streams: `main` runs its work, `side` its staging copies."""

    main: torch.cuda.Stream
    side: torch.cuda.Stream

    def synchronize(self) -> None:
        self.main.synchronize()
        self.side.synchronize()


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of the connector's own on `device`, outside torch's pool."""
    import torch

    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        error = torch.cuda.cudart().cudaStreamCreate(ctypes.addressof(handle))  # type: ignore[no-untyped-call]
    if int(error) != 0:
        raise RuntimeError(f"cudaStreamCreate on {device} failed (cudaError {int(error)})")
    stream: torch.cuda.Stream = torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]
    return stream


class _Kept:
    """Stream pairs no thread holds now, per device, and the fallback side stream of threads that hold
    none (work done at start, outside `on_device`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[torch.device, list[Streams]] = {}
        self._fallback_side: dict[torch.device, torch.cuda.Stream] = {}

    def take(self, device: torch.device) -> Streams:
        with self._lock:
            free = self._free.setdefault(device, [])
            if free:
                return free.pop()
        return Streams(new_stream(device), new_stream(device))

    def give(self, device: torch.device, streams: Streams) -> None:
        with self._lock:
            self._free[device].append(streams)

    def fallback_side(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._fallback_side.get(device)
            if stream is None:
                stream = self._fallback_side[device] = new_stream(device)
            return stream


_kept = _Kept()
_held = threading.local()  # .streams: the Streams this thread holds, if any


def on_device(device: torch.device, work: Callable[..., None]) -> Callable[..., None]:
    """`work`, first making `device` the current CUDA device of the thread that runs it, on streams of
    its own (drained and given back when it ends, however it ends)."""
    if device.type != "cuda":
        return work

    def bound(*args: object) -> None:
        import torch

        torch.cuda.set_device(device)
        streams, held_before = _kept.take(device), getattr(_held, "streams", None)
        _held.streams = streams
        try:
            with torch.cuda.stream(streams.main):
                work(*args)
        finally:
            _held.streams = held_before
            try:
                streams.synchronize()
            finally:
                _kept.give(device, streams)

    return bound


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's stream for staging copies on `device` (CUDA only)."""
    streams: Streams | None = getattr(_held, "streams", None)
    return streams.side if streams is not None else _kept.fallback_side(device)


def settle(device: torch.device) -> None:
    """Returns once the device work the calling thread queued has run, copies included (before a
    transfer reports its outcome: vLLM may then free or reuse the blocks that work reads or writes)."""
    if device.type == "cuda":
        import torch

        torch.cuda.current_stream(device).synchronize()
        side_stream(device).synchronize()


def on_callers_device(work: Callable[..., None]) -> Callable[..., None]:
    """`work`, run on the CUDA device current in the calling thread (none to carry when torch is not
    loaded or CUDA was never initialised there). Only the device: a thread that does device work
    takes its streams with `on_device` (Mooncake's write threads queue none)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return work
    device = torch.device("cuda", torch.cuda.current_device())

    def bound(*args: object) -> None:
        torch.cuda.set_device(device)
        work(*args)

    return bound
