"""What a handler of the router's HTTP server gets and gives back: the parsed request, a whole answer,
and a streamed answer's writer. How they are parsed and written is the connection's (the `httpserver`
package: reading.py, writing.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dllm_router.httpserver.writing import WritingConnection


class Request:
    """One parsed request: method, path (no query), lowercased header names, the whole body."""

    __slots__ = (
        "_conn",
        "_pieces",
        "_size",
        "_url",
        "body",
        "complete",
        "continued",
        "expect_continue",
        "headers",
        "http10",
        "keep_alive",
        "method",
        "path",
        "query",
        "refusal",
        "started",
    )

    def __init__(self, conn: WritingConnection | None = None) -> None:
        self._conn = conn
        self._url = b""
        self._pieces: list[bytes] = []
        self._size = 0
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.keep_alive = True
        self.http10 = False
        self.complete = False
        self.expect_continue = False
        self.continued = False
        self.refusal: tuple[int, str] | None = None  # the server's own answer; then the connection closes
        self.started = False  # an answer's first bytes were written

    def header(self, name: bytes) -> bytes | None:
        """A header's raw value by its lowercased name (repeated headers are joined with ", ")."""
        return self.headers.get(name)

    def stream(self, headers: Mapping[str, str], status: int = 200) -> StreamWriter:
        """Begin a streamed answer (the handler then returns the writer)."""
        if self._conn is None or self._conn.closed:
            raise ConnectionResetError("the client closed the connection")
        return StreamWriter(self._conn, self, status, headers)


class Response:
    """A whole answer: status, body, content type and extra headers (`header_lines`: already formatted
    `Name: value\r\n` lines, for a hot path that has them as bytes)."""

    __slots__ = ("body", "content_type", "header_lines", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        *,
        status: int = 200,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
        header_lines: bytes = b"",
    ) -> None:
        self.status, self.body, self.content_type = status, body, content_type
        self.headers = headers
        self.header_lines = header_lines


class StreamWriter:
    """A streamed answer (status 200 unless given): `await write(data)` per piece, then `await finish()`.

    The head goes out with the first piece (one send fewer). A write while the client is not reading
    waits until its buffer drains. Writing to a client that has gone raises ConnectionResetError.
    """

    __slots__ = ("_chunked", "_conn", "_head", "_request", "finished", "status")

    def __init__(
        self, conn: WritingConnection, request: Request, status: int, headers: Mapping[str, str]
    ) -> None:
        self._conn, self._request = conn, request
        self.status = status
        self._chunked = not request.http10
        if not self._chunked:
            request.keep_alive = False  # HTTP/1.0: the body ends when the connection closes
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        self._head: bytes | None = conn.head(request, status, framing + format_headers(headers))
        self.finished = False

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("the client closed the connection")
        if not data:
            return
        piece = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if self._head is not None:
            piece, self._head = self._head + piece, None
            self._request.started = True
        conn.write(piece)
        if conn.write_paused:
            await conn.drained()

    async def finish(self) -> None:
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("the client closed the connection")
        end = b"0\r\n\r\n" if self._chunked else b""
        if self._head is not None:
            end, self._head = self._head + end, None
        self.finished = True
        conn.write(end)
        if conn.write_paused:
            await conn.drained()


def format_headers(headers: Mapping[str, str] | None) -> bytes:
    """`Name: value` lines; a value with a line break would split the answer, so it is refused."""
    if not headers:
        return b""
    out = b""
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} contains a line break")
        out += name.encode("latin-1") + b": " + value.encode("latin-1", errors="replace") + b"\r\n"
    return out
