"""A short, stable hash of a JSON value (its keys sorted): the desired-hash, template-hash and KV
fingerprint of the rendered children. Pure."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def digest(value: Any, length: int = 20) -> str:
    """The first `length` hex characters of the SHA-256 of `value`'s canonical JSON."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]
