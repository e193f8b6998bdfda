"""The CUDA device a connector thread works on (gpu-review item 2).

A new thread starts with cuda:0 current, whatever the thread that made it had: its first CUDA call (an
event's wait, a copy, Mooncake reading device memory) would open a context on GPU 0, on every TP rank.
Each connector thread therefore makes a device current before its work: the KV's, where the code knows
it (`on_device`), else the one current where the thread was made (`on_callers_device`). Off CUDA (and
where torch is not installed, or nothing initialised CUDA) both leave the work as it is. torch is
imported on use: the side channel runs without it (the connector's wheel without extras).
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
        work(*args)

    return bound


def on_callers_device(work: Callable[..., None]) -> Callable[..., None]:
    """`work`, run on the CUDA device current in the calling thread (none to carry when torch is not
    loaded or CUDA was never initialised there)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return work
    return on_device(torch.device("cuda", torch.cuda.current_device()), work)
