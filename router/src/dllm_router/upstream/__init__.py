"""A lean HTTP/1.1 client for the hot path: keep-alive connections per engine pod, on asyncio protocols.

The router makes two upstream calls per prompt, so the client's cost per call is most of the router's
own. aiohttp's client spent about half of the router's CPU time in profiles (request objects, header
multidicts, URL handling, stream readers); this one writes each request with one `write` and parses
answers incrementally (Content-Length, chunked, or until close), handing body bytes to the reader as
they come. Health checks and /v1/models still use aiohttp.

Errors: `ConnectFailed` (nothing was sent: the pod is down), `Disconnected` (the connection ended before
the whole answer), `BadResponse`; a timeout raises TimeoutError. A request that meets a keep-alive
connection the pod had already closed is resent once on a fresh connection.

The pool (pool.py) holds a pod's connections (connection.py, whose answers' framing helpers are in
framing.py) and sends a POST either as a `Call` (call.py: callbacks, its time limit kept by `Deadlines`,
deadlines.py) or for a `Response` (response.py: read by a coroutine); errors.py has the errors.
"""

from dllm_router.upstream.call import Call
from dllm_router.upstream.deadlines import Deadlines
from dllm_router.upstream.errors import BadResponse, ConnectFailed, Disconnected, UpstreamError
from dllm_router.upstream.framing import chunk_size
from dllm_router.upstream.pool import UpstreamPool
from dllm_router.upstream.response import Response

__all__ = [
    "BadResponse",
    "Call",
    "ConnectFailed",
    "Deadlines",
    "Disconnected",
    "Response",
    "UpstreamError",
    "UpstreamPool",
    "chunk_size",
]
