"""Reading an HTTP/1.1 answer's framing from its bytes: a chunk-size line, a header's value."""

from __future__ import annotations

import re

_CHUNK_SIZE_RE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:;[^\r\n]*)?")


def chunk_size(line: bytes) -> int | None:
    """A chunk-size line's size: hex digits only, optionally `;extensions` (L7: `int(x, 16)` also took
    `-1`, `0x10`, `1_0` and spaces). None when the line is not that."""
    match = _CHUNK_SIZE_RE.fullmatch(line)
    return None if match is None else int(match.group(1), 16)


def header_field(head: bytes, prefix: bytes) -> bytes | None:
    """The value of the first header line starting with `prefix` (`\\r\\nname:`), stripped."""
    start = head.find(prefix)
    if start < 0:
        return None
    start += len(prefix)
    end = head.find(b"\r\n", start)
    return (head[start:] if end < 0 else head[start:end]).strip()
