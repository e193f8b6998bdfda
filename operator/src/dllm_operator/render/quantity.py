"""Kubernetes resource quantities, as far as the operator needs them: values to compare, bytes in, Mi
out. (The syntax a CR may use is checked by the API model: api.common.QUANTITY.)"""

from __future__ import annotations

import math
import re

_SUFFIX = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "m": 10**-3, "u": 10**-6, "n": 10**-9,
}  # fmt: skip
# Kubernetes' resource.Quantity: a signed number, then a suffix or a decimal exponent (1e3, 5E-2).
_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_QUANTITY = re.compile(rf"^({_NUMBER})(?:([KMGTPE]i|[numkMGTPE])|[eE]({_NUMBER}))?$")


def amount(quantity: object) -> float | None:
    """A quantity's value (1Gi -> 1073741824.0, 500m -> 0.5, 2 -> 2.0); None for anything else (a bool
    is no quantity)."""
    if isinstance(quantity, bool) or not isinstance(quantity, (int, str)):
        return None
    if isinstance(quantity, int):
        return float(quantity)
    match = _QUANTITY.match(quantity.strip())
    if not match:
        return None
    number, suffix, exponent = match.groups()
    scale = _SUFFIX[suffix or ""] if exponent is None else 10 ** float(exponent)
    return float(number) * scale


def to_bytes(quantity: str | int) -> int:
    """Parse a memory quantity; raises ValueError for anything else."""
    if isinstance(quantity, int):
        return quantity
    value = amount(quantity)
    if value is None:
        raise ValueError(f"{quantity!r} is not a memory quantity")
    return math.ceil(value)


def mebibytes(n_bytes: int) -> str:
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def gigabytes_to_bytes(gb: float) -> int:
    """The KV buffer size is given in GB as vLLM users write it (binary: 1 GB = 2**30 bytes)."""
    return math.ceil(gb * 2**30)
