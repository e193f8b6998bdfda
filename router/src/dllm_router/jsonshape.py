"""What a JSON body would cost to parse, measured on its bytes before `json.loads` runs (H2, L1).

`json.loads` holds the GIL from start to end (a thread does not help) and objects cost far more than
their bytes: a few MB of `[1],` parse into lists many times that size, for seconds (figures in
docs/router.md, What a request may cost). So the router measures the shape first, with C-speed
bytes operations only (count, replace, split, translate), and refuses a body with too many strings,
arrays and objects, too many values, or too deep a nesting. Within these limits a parse takes tens
of milliseconds at most (see `MAX_*`), and deep nesting never reaches a RecursionError.

Exact for valid JSON: escaped backslashes and escaped quotes are removed first, so every quote left
delimits a string, and the text between strings is what the counts see. Invalid JSON may be counted
wrongly; `json.loads` refuses it afterwards either way.
"""

from __future__ import annotations

# Each limit keeps its kind's share of a parse within tens of milliseconds (per-item costs in
# docs/router.md, What a request may cost).
MAX_STRINGS = 200_000
MAX_CONTAINERS = 20_000  # arrays and objects
MAX_VALUES = 1_000_000  # commas outside strings bound the values
MAX_DEPTH = 64  # vLLM's own schemas nest a few levels; Python's parser recurses per level

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)


class TooComplex(ValueError):
    """The body's shape is over a limit; the message says which."""


def check_shape(raw: bytes) -> None:
    """Raise TooComplex when parsing `raw` would cost more than the limits allow."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_DEPTH and raw.count(b'"') <= 2 * MAX_STRINGS and raw.count(b",") <= MAX_VALUES:
        return  # the common small body: the raw counts are upper bounds already
    cleaned = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    quotes = cleaned.count(b'"')
    if quotes > 2 * MAX_STRINGS + 1:
        raise TooComplex(f"request JSON has more than {MAX_STRINGS} strings")
    outside = b"".join(cleaned.split(b'"')[0::2]) if quotes else cleaned
    brackets = outside.translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * MAX_CONTAINERS + 1:
        raise TooComplex(f"request JSON has more than {MAX_CONTAINERS} arrays and objects")
    if outside.count(b",") > MAX_VALUES:
        raise TooComplex(f"request JSON has more than {MAX_VALUES} values")
    if brackets.count(b"[") + brackets.count(b"{") > MAX_DEPTH:
        _check_depth(brackets)


def _check_depth(brackets: bytes) -> None:
    depth = 0
    for b in brackets:  # at most 2 * MAX_CONTAINERS + 1 bytes
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > MAX_DEPTH:
                raise TooComplex(f"request JSON nests deeper than {MAX_DEPTH} levels")
        else:
            depth -= 1
