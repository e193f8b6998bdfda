"""Kubernetes resource quantities, as far as the operator needs them: values to compare, bytes in, Mi
out. Read with the grammar the API model checks a CR against (api.common.QUANTITY, the CRD's pattern)."""

from __future__ import annotations

import math

from dllm_operator.api.common import QUANTITY

_SUFFIX = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "m": 10**-3, "u": 10**-6, "n": 10**-9,
}  # fmt: skip
# QUANTITY's groups: 1 the sign, 2 the number, 6 what follows it (a suffix, or a decimal exponent,
# which group 8 then holds whole: "e3", "E-1").
_SIGN, _NUMBER, _SUFFIX_OR_EXPONENT, _EXPONENT = 1, 2, 6, 8


def amount(quantity: object) -> float | None:
    """A quantity's value (1Gi -> 1073741824.0, 500m -> 0.5, 2 -> 2.0); None for anything else (a bool
    is no quantity)."""
    if isinstance(quantity, bool) or not isinstance(quantity, (int, str)):
        return None
    if isinstance(quantity, int):
        return float(quantity)
    match = QUANTITY.match(quantity.strip())
    if not match:
        return None
    number = float((match[_SIGN] or "") + match[_NUMBER])
    if match[_EXPONENT] is not None:
        return number * 10 ** float(match[_EXPONENT][1:])
    return number * _SUFFIX[match[_SUFFIX_OR_EXPONENT] or ""]


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
