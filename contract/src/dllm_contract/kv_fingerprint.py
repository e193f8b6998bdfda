"""The KV-compatibility fingerprint between the three that use it: the operator gives both roles' pods
one in their env (its render/fingerprint.py), dllm-serve answers it on /health in a header, and the
router reads it there and pairs only pods that share it."""

from __future__ import annotations

import re

ENV_KV_FINGERPRINT = "DLLM_KV_FINGERPRINT"
HEADER = "X-Dllm-Kv-Fingerprint"
_FINGERPRINT = re.compile(r"[0-9a-f]{1,64}")


def valid(value: str | None) -> str | None:
    """`value` when it is a fingerprint (lower-case hex, at most 64 characters); anything else: None."""
    return value if value is not None and _FINGERPRINT.fullmatch(value) else None
