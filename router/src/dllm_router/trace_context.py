"""W3C Trace Context from the client to both engine calls, so that one request's two legs are one trace.

The router makes no spans of its own: it passes the client's `traceparent` (and `tracestate`) to prefill
and decode unchanged, so each engine's span (vLLM's, with `--otlp-traces-endpoint`) is a child of the
client's. A request without one gets a new `traceparent` (random trace and parent ids, sampled, as vLLM
samples a request that comes without one), so its two legs still share a trace. A header that is not
W3C's version-00 form is replaced, never passed on: the specification's answer to an invalid parent.
"""

from __future__ import annotations

import re
import secrets

from dllm_router.http_messages import Request

# version 00: trace id (16 bytes) and parent id (8 bytes) in lower-case hex, then the flags
_TRACEPARENT = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_ZERO_TRACE, _ZERO_PARENT = b"0" * 32, b"0" * 16
# W3C asks every hop to pass at least 512 characters of tracestate; longer ones are dropped whole.
MAX_TRACESTATE = 512
_TRACESTATE_BYTES = frozenset(range(0x20, 0x7F))


def valid_traceparent(value: bytes) -> bool:
    match = _TRACEPARENT.fullmatch(value)
    return match is not None and match[1] != _ZERO_TRACE and match[2] != _ZERO_PARENT


def new_traceparent() -> bytes:
    return b"00-" + secrets.token_hex(16).encode() + b"-" + secrets.token_hex(8).encode() + b"-01"


def trace_lines(request: Request) -> bytes:
    """The header lines both engine calls carry for the trace: the client's, or a new parent."""
    parent = request.header(b"traceparent")
    if parent is None or not valid_traceparent(parent):
        return b"traceparent: " + new_traceparent() + b"\r\n"
    lines = b"traceparent: " + parent + b"\r\n"
    state = request.header(b"tracestate")
    if state and len(state) <= MAX_TRACESTATE and _TRACESTATE_BYTES.issuperset(state):
        lines += b"tracestate: " + state + b"\r\n"
    return lines
