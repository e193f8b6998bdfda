"""A small HTTP/1.1 server for the router's hot path: asyncio protocols and httptools' C parser (llhttp).

aiohttp's server cost the router more per request than the rest of its work (docs/router.md), even for a
handler returning a constant (request objects, header multidicts, payload streams, a task and several
futures per request). This one parses with llhttp, keeps headers as a plain dict of lowercased bytes,
hands the handler the whole body, and writes each answer with one `write`. A route may also have a
`FastHandler`, called with the complete request from the parser's callback, which answers by callbacks
(no task per request) or hands the request to a task. What a handler gets and gives back (Request,
Response, StreamWriter) is in `http_messages.py`; this package is the rest: the server (server.py), its
handlers' types (handlers.py), its limits (limits.py), and the connection that parses and writes, one
class in layers (state.py, writing.py, reading.py, connection.py).

Behaviour a client sees:
- keep-alive (HTTP/1.1 by default, HTTP/1.0 on request); pipelined requests are answered in order,
  one at a time per connection; a `Connection: close` request closes after its answer;
- request bodies by Content-Length or chunked; over `max_body` the answer is 413 (before the body is read
  when its length is declared) and the connection is closed; `Expect: 100-continue` gets `100 Continue`
  when the request is next in line and its body is within the limit;
- a malformed request gets 400 (an over-long head 431) and the connection is closed; the head's size is
  counted before its bytes reach the parser (H1), so one unterminated header cannot grow;
- a head must arrive within `head_timeout_s` of its first byte and a body within `body_timeout_s` of
  its head, else 408 and close (M1); a connection that begins no request within `first_byte_timeout_s`
  is closed; at `max_connections` open connections a new one takes the slot of the one idle longest
  (no request in progress), and gets 503 and is closed only when there is none (NEW-5);
- write back-pressure (H3): while the transport's writes are paused (the client does not read), no
  further request is read or started; a connection whose writes stay paused for `write_timeout_s` is
  aborted, as is an idle one whose answer never drained;
- streamed answers use chunked transfer encoding (raw bytes until close for HTTP/1.0 clients), and a
  writer waits while the client does not read (the transport's pause_writing / resume_writing);
- a client that closes its connection cancels the handler of its request (as aiohttp's
  `handler_cancellation`), so the router's upstream calls are cancelled too;
- `cleanup(drain_s)` stops listening, closes idle connections, lets requests in flight finish (each
  connection closes after its answer) for up to `drain_s`, then cancels the rest.
"""

from dllm_router.http_messages import Request, Response, StreamWriter
from dllm_router.httpserver.connection import Connection
from dllm_router.httpserver.handlers import ErrorPage, FastHandler, Handler, Pending, plain_error
from dllm_router.httpserver.limits import MAX_HEAD
from dllm_router.httpserver.server import HttpServer
from dllm_router.httpserver.writing import status_line

# The server's API: its messages (http_messages.py) are part of it, so a handler's module may import
# everything from here.
__all__ = [
    "MAX_HEAD",
    "Connection",
    "ErrorPage",
    "FastHandler",
    "Handler",
    "HttpServer",
    "Pending",
    "Request",
    "Response",
    "StreamWriter",
    "plain_error",
    "status_line",
]
