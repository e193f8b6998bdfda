"""How a connection writes: an answer's head, a whole answer in one `write`, back-pressure, closing."""

from __future__ import annotations

from http import HTTPStatus

from dllm_router.http_messages import Request, Response, format_headers
from dllm_router.httpserver.state import ConnectionState

_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())
    return line


class WritingConnection(ConnectionState):
    """Bytes out to the client."""

    def head(self, request: Request, status: int, headers: bytes) -> bytes:
        if self.server.draining:
            request.keep_alive = False
        if not request.keep_alive:
            connection = b"Connection: close\r\n"
        elif request.http10:
            connection = b"Connection: keep-alive\r\n"
        else:
            connection = b""
        return status_line(status) + self.server.date_line() + connection + headers + b"\r\n"

    def _write_whole(self, request: Request, page: Response) -> None:
        body = page.body
        headers = (
            _content_type_line(page.content_type)
            + b"Content-Length: %d\r\n" % len(body)
            + page.header_lines
            + format_headers(page.headers)
        )
        head = self.head(request, page.status, headers)
        request.started = True
        self.write(head if request.method == "HEAD" else head + body)

    def write(self, data: bytes) -> None:
        if not self.closed:
            assert self.transport is not None
            self.transport.write(data)

    async def drained(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._drain is None or self._drain.done():
            self._drain = self.loop.create_future()
        await self._drain

    def close(self) -> None:
        """Close after what is written has gone out; an answer that cannot go out is dropped."""
        transport = self.transport
        if not self.closed and transport is not None:
            if self._paused_since is None and transport.get_write_buffer_size():
                self._paused_since = self.loop.time()  # what is left must go out within write_timeout_s
            transport.close()

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.abort()


_CONTENT_TYPES: dict[str, bytes] = {}


def _content_type_line(content_type: str) -> bytes:
    line = _CONTENT_TYPES.get(content_type)
    if line is None:
        line = _CONTENT_TYPES[content_type] = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n"
    return line
