"""Copies between the KV's device and host staging, and marks of when written bytes may go on the wire.

The pinned-host path (transport.placement) encodes a batch on the KV's device into a scratch
payload and copies it into page-locked host staging range by range as each layer is encoded, so
that the copy of piece k+1 runs while piece k is on the wire; decode copies each piece back as it
arrives. On CUDA the copies are non_blocking on the calling thread's side stream (each connector
thread works on streams of its own, thread_device), and the writer waits for a piece's event before
the transport reads it. On the CPU the same calls copy synchronously and every mark is
ready at once: the code paths are those the tests run here. The CUDA lines are `_CudaCopies`,
behind the one check in `Copies`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm_connector.thread_device import side_stream
from dllm_connector.transport.staging import StagingBuffer, device_bytes

# Called before the transport reads bytes written on the device: returns once they are written.
Ready = Callable[[], None]


def ready_now() -> None:
    """Host work is done by the time it returns: nothing to wait for."""


class _CudaCopies:
    """CUDA only: copies on the calling thread's side stream (thread_device), ordered after the current
    stream's kernels. One side stream shared by every transfer would order each one's copies after the
    others' (gpu-review item 13)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def _side(self) -> torch.cuda.Stream:
        return side_stream(self._device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ready:
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self._device))  # after what wrote src
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
        return done.synchronize

    def mark(self) -> Ready:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event.synchronize

    def join(self) -> None:
        torch.cuda.current_stream(self._device).wait_stream(self._side())

    def after_default_stream(self) -> None:
        torch.cuda.current_stream(self._device).wait_stream(torch.cuda.default_stream(self._device))


class Copies:
    """Byte copies for one KV device: asynchronous on CUDA, synchronous elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = _CudaCopies(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ready:
        """dst <- src; the Ready returns once dst holds the bytes."""
        if self._cuda is None:
            dst.copy_(src)
            return ready_now
        return self._cuda.copy(dst, src)

    def mark(self) -> Ready:
        """Ready once the work queued so far (e.g. an encode into device staging) is done."""
        return ready_now if self._cuda is None else self._cuda.mark()

    def join(self) -> None:
        """Later work (an encode into the scratch the copies read, a decode of what they wrote)
        runs after every copy issued so far."""
        if self._cuda is not None:
            self._cuda.join()

    def landed(self) -> None:
        """Work queued from here on reads what a transport wrote into device memory after the transport
        said so: on CUDA it waits for the legacy default stream, where Mooncake's TCP build copies
        into device memory (such a copy may still run when the peer's message arrives, and a
        connector thread's own stream does not wait for that stream by itself). Queued, no host wait."""
        if self._cuda is not None:
            self._cuda.after_default_stream()


class HostMirror:
    """A payload worked on in `work` (on the KV's device), mirrored in host staging `host` range by
    range: encode, then `to_host` (sender); `to_device`, then decode (receiver)."""

    def __init__(self, work: torch.Tensor, host: torch.Tensor, copies: Copies) -> None:
        if work.numel() < host.numel():
            raise ValueError(f"a {work.numel()}-byte scratch cannot mirror {host.numel()} bytes of staging")
        self.work, self.host, self._copies = work, host, copies

    def to_host(self, ranges: list[tuple[int, int]]) -> Ready:
        ready: Ready = ready_now
        for start, stop in ranges:
            ready = self._copies.copy(self.host[start:stop], self.work[start:stop])
        return ready  # one stream: the last copy's mark covers the earlier ones

    def to_device(self, ranges: list[tuple[int, int]]) -> None:
        for start, stop in ranges:
            self._copies.copy(self.work[start:stop], self.host[start:stop])
        self._copies.join()


class Scratch:
    """The pinned-host path's work space on the KV's device: one buffer as large as the host staging
    it mirrors, allocated once at start. A reservation's scratch is the slice at the reservation's
    own offset, so the scratch in use is bounded by the staging (bufferSizeGB) and held exactly as
    long as the reservation, whatever the number of threads sending and receiving."""

    def __init__(self, staging: StagingBuffer, device: torch.device) -> None:
        self._staging = staging
        self.buffer = device_bytes(staging.capacity, device)  # as large as the staging it mirrors

    def take(self, view: torch.Tensor) -> torch.Tensor:
        """The scratch mirroring `view`, a reservation of the staging (or part of one)."""
        offset = self._staging.offset(view)
        return self.buffer[offset : offset + view.numel()]
