"""Decode's staging for one transfer's chunks on a one-sided transport, with back-pressure."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dllm_connector.transport.staging import StagingBuffer

_ALIGN = 64


class StagingWindow:
    """Decode's staging for one transfer's chunks on a one-sided transport.

    Where the whole payload fits the buffer it is one reservation, and every slot is named up
    front. Where it does not, the chunks go through a window of at most half the buffer (at least
    one chunk): each chunk's slot is freed once it is decoded, and later chunks' slots are reserved
    and named to the sender, which waits for them (back-pressure inside one transfer). A window only
    waits for room while it holds no slot, so transfers sharing the buffer cannot deadlock: whoever
    holds slots is being written and will free them.
    """

    def __init__(self, staging: StagingBuffer, sizes: Sequence[int], timeout: float) -> None:
        self._staging, self._sizes, self._timeout = staging, list(sizes), timeout
        self._views: dict[int, torch.Tensor] = {}
        self._whole: torch.Tensor | None = None
        self._next = 0  # the first chunk without a slot
        offsets = chunk_offsets(sizes)
        if offsets[-1] <= staging.capacity:
            self._whole = staging.reserve(offsets[-1], timeout)
            self._views = {i: self._whole[offsets[i] : offsets[i] + n] for i, n in enumerate(sizes)}
            self._next = len(sizes)
        else:
            self._wait_for_next()
            self._fill()

    def slots(self) -> list[tuple[int, int]]:
        """(chunk index, address) of every slot reserved so far."""
        return [(index, view.data_ptr()) for index, view in sorted(self._views.items())]

    def view(self, index: int) -> torch.Tensor:
        return self._views[index]

    def decoded(self, index: int) -> list[tuple[int, int]]:
        """Chunk `index` is done with: in a window, free its slot; the slots newly reserved."""
        if self._whole is not None:
            return []
        self._staging.release(self._views.pop(index))
        new = [self._wait_for_next()] if not self._views and self._next < len(self._sizes) else []
        return new + self._fill()

    def _wait_for_next(self) -> tuple[int, int]:
        """Reserve the next chunk's slot, waiting for room (only while holding none)."""
        index = self._next
        self._views[index] = self._staging.reserve(self._sizes[index], self._timeout)
        self._next += 1
        return index, self._views[index].data_ptr()

    def _fill(self) -> list[tuple[int, int]]:
        """Reserve further slots while the window has room and so does the buffer, now."""
        new = []
        held = sum(view.numel() for view in self._views.values())
        while self._next < len(self._sizes) and held + self._sizes[self._next] <= self._staging.capacity // 2:
            view = self._staging.try_reserve(self._sizes[self._next])
            if view is None:
                break
            self._views[self._next] = view
            new.append((self._next, view.data_ptr()))
            held += view.numel()
            self._next += 1
        return new

    def release(self) -> None:
        if self._whole is not None:
            self._staging.release(self._whole)
        else:
            for view in self._views.values():
                self._staging.release(view)
        self._whole, self._views = None, {}


def chunk_offsets(sizes: Sequence[int]) -> list[int]:
    offsets, cursor = [], 0
    for size in sizes:
        offsets.append(cursor)
        cursor += -(-size // _ALIGN) * _ALIGN
    return [*offsets, cursor]
