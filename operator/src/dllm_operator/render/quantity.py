"""Kubernetes resource quantities, as far as the renderer needs them: bytes in, Mi out."""

from __future__ import annotations

import math
import re

_SUFFIX = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "m": 10**-3,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([a-zA-Z]*)$")


def to_bytes(quantity: str | int) -> int:
    """Parse a memory quantity; raises ValueError for anything else."""
    if isinstance(quantity, int):
        return quantity
    match = _QUANTITY.match(quantity.strip())
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"{quantity!r} is not a memory quantity")
    return math.ceil(float(match.group(1)) * _SUFFIX[match.group(2)])


def mebibytes(n_bytes: int) -> str:
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def gigabytes_to_bytes(gb: float) -> int:
    """The KV buffer size is given in GB as vLLM users write it (binary: 1 GB = 2**30 bytes)."""
    return math.ceil(gb * 2**30)
