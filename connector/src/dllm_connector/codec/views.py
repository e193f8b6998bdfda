"""Tensors handed to compiled kernels as no views."""

from __future__ import annotations

from typing import Any

import torch


def unviewed(arg: Any) -> Any:
    """A view as a tensor over the same memory that is no view (anything else as it is): torch.compile
    guards on a view's base too, and a one-row base (a one-block batch) compiled a kernel again on a
    request's path."""
    if not isinstance(arg, torch.Tensor) or not arg._is_view():
        return arg
    alias = torch.empty(0, dtype=arg.dtype, device=arg.device)
    return alias.set_(arg.untyped_storage(), arg.storage_offset(), arg.shape, arg.stride())
