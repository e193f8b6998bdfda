"""The CUDA device and stream a connector thread works on (gpu-review items 2 and 13).

A new thread starts with cuda:0 current, whatever the thread that made it had: its first CUDA call (an
event's wait, a copy, Mooncake reading device memory) would open a context on GPU 0, on every TP rank.
Each connector thread therefore makes a device current before its work: the KV's, where the code knows
it (`on_device`), else the one current where the thread was made (`on_callers_device`).

A new thread's current stream is also the legacy default stream, which every other blocking stream
waits for and which waits for them: transfers running at once would queue behind one another, and a
host read of one (a checksum's value) would wait for all. Each connector thread's work therefore runs
on a stream of its own, one of torch's pool (non-blocking, made once per device). Nothing it queues is
ordered after vLLM's kernels: the blocks a transfer reads or writes are the transfer's alone (prefill
sends a request's blocks once vLLM saw its last token, decode's blocks are not read until the load is
reported), and the transfer fences its own work on the host before it reports (`settle`) and before it
hands staging on. The thread's stream is drained before the thread ends, so nothing it queued outlives it.

Off CUDA (and where torch is not installed, or nothing initialised CUDA) these leave the work as it is.
torch is imported on use: the side channel runs without it (the connector's wheel without extras).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def on_device(device: torch.device, work: Callable[..., None]) -> Callable[..., None]:
    """`work`, first making `device` the current CUDA device of the thread that runs it."""
    if device.type != "cuda":
        return work

    def bound(*args: object) -> None:
        import torch

        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        try:
            with torch.cuda.stream(stream):
                work(*args)
        finally:
            stream.synchronize()

    return bound


def settle(device: torch.device) -> None:
    """Returns once the device work the calling thread queued has run (before a transfer reports its
    outcome: vLLM may then free or reuse the blocks that work reads or writes)."""
    if device.type == "cuda":
        import torch

        torch.cuda.current_stream(device).synchronize()


def on_callers_device(work: Callable[..., None]) -> Callable[..., None]:
    """`work`, run on the CUDA device current in the calling thread (none to carry when torch is not
    loaded or CUDA was never initialised there)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return work
    return on_device(torch.device("cuda", torch.cuda.current_device()), work)
