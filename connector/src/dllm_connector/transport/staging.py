"""A registered staging buffer for compressed KV, with a first-fit range allocator.

The buffer is allocated and registered once (bufferSizeGB), where the data path puts it
(transport.placement): in host memory, page-locked host memory (the pinned-host path), or device
memory (the device path). Reservations wait for space up to a deadline, which is the back-pressure
when the buffer is full; every reservation is released on every path, and `in_use` lets tests
prove it.
"""

from __future__ import annotations

import bisect
import threading
import time

import torch

from dllm_connector.transport.base import TransferTimeout, TransportError

_ALIGN = 64


def pinned_host_bytes(nbytes: int) -> tuple[torch.Tensor, str]:
    """`nbytes` of page-locked host memory, and a note: torch pins memory only where an accelerator
    is present; without one (this CPU-only machine) the buffer is plain host memory, and the note
    says so (the worker logs it with the data path)."""
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), ""
    note = "no accelerator to pin host memory for: the staging buffer is plain host memory"
    return torch.empty(nbytes, dtype=torch.uint8), note


def device_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` on `device`; on a device too full for them, a TransportError that says what to change
    (the data path's automatic choice then stages in pinned host memory instead). vLLM sizes its KV
    cache before the connector registers, so this comes out of what --gpu-memory-utilization left
    (gpu-review item 4)."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as error:
        raise TransportError(
            f"{nbytes / 2**30:.2f} GiB of KV staging does not fit on {device} after vLLM's KV cache: "
            "lower kvTransfer.bufferSizeGB or vLLM's --gpu-memory-utilization "
            f"({str(error).splitlines()[0][:200]})"
        ) from None


class StagingBuffer:
    """`device`: where the buffer lives (host by default); `pinned`: page-locked host memory."""

    def __init__(self, nbytes: int, *, device: torch.device | None = None, pinned: bool = False) -> None:
        if nbytes <= 0:
            raise TransportError("the staging buffer needs a positive size")
        device = device or torch.device("cpu")
        if pinned and device.type != "cpu":
            raise TransportError(f"a pinned staging buffer is host memory, not {device}")
        self.note = ""
        if pinned:
            self.tensor, self.note = pinned_host_bytes(nbytes)
        else:
            self.tensor = device_bytes(nbytes, device)
        self._spans: list[tuple[int, int]] = []  # sorted (offset, length) in use
        self._cond = threading.Condition()

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    @property
    def in_use(self) -> int:
        with self._cond:
            return sum(length for _, length in self._spans)

    def check_fits(self, nbytes: int) -> int:
        """The aligned length a reservation of nbytes takes; raises if it can never fit."""
        length = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if length > self.capacity:
            raise TransportError(f"{nbytes} bytes of KV exceed the {self.capacity}-byte staging buffer")
        return length

    def reserve(self, nbytes: int, timeout: float) -> torch.Tensor:
        """A view of nbytes of the buffer; waits for space until timeout (back-pressure)."""
        length = self.check_fits(nbytes)
        deadline = time.monotonic() + timeout
        with self._cond:
            while (view := self._take_locked(nbytes, length)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"staging buffer full: no {nbytes} bytes within {timeout:.1f}s")
                self._cond.wait(left)
        return view

    def try_reserve(self, nbytes: int) -> torch.Tensor | None:
        """A view of nbytes of the buffer if there is room now, else None (never waits)."""
        length = self.check_fits(nbytes)
        with self._cond:
            return self._take_locked(nbytes, length)

    def _take_locked(self, nbytes: int, length: int) -> torch.Tensor | None:
        """The first free range of `length` bytes, marked in use; None if there is none."""
        offset = self._first_fit(length)
        if offset is None:
            return None
        bisect.insort(self._spans, (offset, length))
        return self.tensor[offset : offset + nbytes]

    def _first_fit(self, length: int) -> int | None:
        cursor = 0
        for offset, used in self._spans:
            if offset - cursor >= length:
                return cursor
            cursor = offset + used
        return cursor if self.capacity - cursor >= length else None

    def offset(self, view: torch.Tensor) -> int:
        """Where a view of this buffer (a reservation, or part of one) starts in it."""
        offset = view.data_ptr() - self.tensor.data_ptr()
        if not 0 <= offset <= offset + view.numel() <= self.capacity:
            raise TransportError(f"{view.numel()} bytes at offset {offset} are not in the staging buffer")
        return offset

    def release(self, view: torch.Tensor) -> None:
        offset = view.data_ptr() - self.tensor.data_ptr()
        with self._cond:
            for index, (start, _) in enumerate(self._spans):
                if start == offset:
                    del self._spans[index]
                    self._cond.notify_all()
                    return
        raise TransportError(f"no staging reservation at offset {offset}")
