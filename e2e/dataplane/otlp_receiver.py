"""An OTLP/HTTP trace receiver on 127.0.0.1, for tests: vLLM's exporter (`--otlp-traces-endpoint` with
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf) posts its spans here, decoded with OpenTelemetry's
own protobuf messages. It keeps what a trace viewer would join on: trace, span and parent ids, the
span's name and attributes, and the attributes of the process that made it.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _values(pairs: Any) -> dict[str, Any]:
    def one(kv: KeyValue) -> Any:
        kind = kv.value.WhichOneof("value")
        return getattr(kv.value, kind) if kind else None

    return {kv.key: one(kv) for kv in pairs}


def spans_of(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = _values(resource_spans.resource.attributes)
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                found.append(
                    Span(
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.name,
                        _values(span.attributes),
                        resource,
                    )
                )
    return found


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
                    self.send_error(400)
                    return
                body = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver.spans += spans_of(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]


@contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver._server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()
