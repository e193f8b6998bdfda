"""One keep-alive connection to a pod: a request written, its answer parsed as it arrives (Content-Length,
chunked, or until close) and handed to the request's reader (a Response, or a Call)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from dllm_router.upstream.errors import BadResponse, Disconnected
from dllm_router.upstream.framing import chunk_size, header_field

if TYPE_CHECKING:
    from dllm_router.upstream.pool import UpstreamPool

MAX_HEAD = 64 * 1024
MAX_LINE = 4096  # a chunk-size line, extensions included

_IDLE, _HEAD, _LENGTH, _DONE_LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE = range(9)


class AnswerSink(Protocol):
    """Who reads the answer to the request on a connection: a Response, or a Call."""

    def head_ready(self, status: int) -> None:
        """The answer's status (an interim 1xx answer is skipped)."""

    def feed(self, data: bytes) -> None:
        """Body bytes, the framing removed."""

    def finish(self) -> None:
        """The body is complete."""

    def whole(self, status: int, body: bytes) -> None:
        """A whole answer that came in one read: status and body at once."""

    def fail(self, error: BaseException) -> None:
        """The answer will not complete."""


class UpstreamConnection(asyncio.Protocol):
    """One connection of a pool, answering one request at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._buf = bytearray()
        self.sink: AnswerSink | None = None
        self._state = _IDLE
        self._remaining = 0
        self._keep_alive = True
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass

    def send(self, data: bytes, sink: AnswerSink) -> None:
        assert self.transport is not None
        self.sink, self._state, self._keep_alive = sink, _HEAD, True
        self.transport.write(data)

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def expire(self) -> None:
        self._fail(TimeoutError(f"{self.pool.name} did not answer in time"))

    def data_received(self, data: bytes) -> None:
        if self.sink is None:  # nothing was asked: a broken or chatty server
            self.close()
            return
        if self._state == _HEAD and not self._buf and self._take_whole(data):
            return
        self._buf += data
        try:
            self._parse()
        except BadResponse as e:  # its traceback's frames hold `data` and the buffer: not kept (NEW-1)
            self._fail(e.with_traceback(None))

    def eof_received(self) -> bool:
        self.closed = True  # the pod is closing it: not to be taken from the pool meanwhile
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.sink is None:
            return
        if self._state == _UNTIL_CLOSE:
            self._done()
            return
        before_head = self._state == _HEAD
        where = "before its answer" if before_head else "in the middle of its answer"
        self._fail(Disconnected(f"{self.pool.name} closed the connection {where}: {exc!r}", before_head))

    def _fail(self, error: BaseException) -> None:
        sink, self.sink = self.sink, None
        self.close()
        self._buf = bytearray()
        if sink is not None:
            sink.fail(error)

    def _done(self) -> None:
        sink, self.sink = self.sink, None
        self._state = _IDLE
        if self._keep_alive and not self.closed and not self._buf:
            self.resume()  # a streamed answer's reader may have paused it
            self.pool.put_back(self)  # first: whoever the answer wakes may call this pod again
        else:
            self.close()
        if sink is not None:
            sink.finish()

    def _take_whole(self, data: bytes) -> bool:
        """The common answer in one piece: an HTTP/1.1 head with Content-Length and exactly that much
        body. Taken without copying through the buffer; False leaves anything else to `_parse`."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or not data.startswith(b"HTTP/1.1 2") or data[12:13] != b" ":
            return False
        code = data[9:12]
        low = data[:end].lower()
        length = header_field(low, b"\r\ncontent-length:")
        if (
            not code.isdigit()
            or code == b"204"  # no body whatever the head says: the general parser's case
            or length is None
            or not length.isdigit()
            or len(data) != end + 4 + int(length)
            or b"\r\ntransfer-encoding:" in low
        ):
            return False
        connection = header_field(low, b"\r\nconnection:")
        sink, self.sink = self.sink, None
        self._state = _IDLE
        if connection is None or b"close" not in connection:
            self.pool.put_back(self)
        else:
            self.close()
        assert sink is not None
        sink.whole(int(code), data[end + 4 :])
        return True

    def _parse(self) -> None:
        buf = self._buf
        while buf or self._state in (_DONE_LENGTH,):
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise BadResponse(f"{self.pool.name}: response head over {MAX_HEAD} bytes")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._start_body(head)
            elif state in (_LENGTH, _CHUNK_DATA, _UNTIL_CLOSE):
                take = len(buf) if state == _UNTIL_CLOSE else min(len(buf), self._remaining)
                assert self.sink is not None
                self.sink.feed(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if self._remaining == 0 and state != _UNTIL_CLOSE:
                    self._state = _DONE_LENGTH if state == _LENGTH else _CHUNK_END
            elif state == _DONE_LENGTH:
                self._done()
                return
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_LINE:
                        raise BadResponse(f"{self.pool.name}: chunk-size line over {MAX_LINE} bytes")
                    return
                size = chunk_size(bytes(buf[:end]))
                if size is None:
                    raise BadResponse(f"{self.pool.name}: bad chunk size {bytes(buf[:end])[:20]!r}")
                del buf[: end + 2]
                self._state, self._remaining = (_TRAILERS, 0) if size == 0 else (_CHUNK_DATA, size)
            elif state == _CHUNK_END:
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise BadResponse(f"{self.pool.name}: trailer line over {MAX_HEAD} bytes")
                    return
                del buf[: end + 2]
                if end == 0:
                    self._done()
                    return
            else:
                raise BadResponse(f"{self.pool.name}: bytes after the answer")

    def _start_body(self, head: bytes) -> None:
        end = head.find(b"\r\n")
        parts = (head if end < 0 else head[:end]).split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadResponse(f"{self.pool.name}: not an HTTP/1.x answer: {head[:40]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real head follows
        low = head.lower()  # one pass; only the framing headers are read, by search, not split
        connection = header_field(low, b"\r\nconnection:")
        self._keep_alive = (connection is None or b"close" not in connection) and (
            parts[0] == b"HTTP/1.1" or (connection is not None and b"keep-alive" in connection)
        )
        length = header_field(low, b"\r\ncontent-length:")
        encoding = header_field(low, b"\r\ntransfer-encoding:")
        if status in (204, 304):
            self._state, self._remaining = _DONE_LENGTH, 0
        elif encoding is not None and b"chunked" in encoding:
            self._state = _CHUNK_SIZE
        elif length is not None:
            if not length.isdigit():
                raise BadResponse(f"{self.pool.name}: bad Content-Length {length[:20]!r}")
            self._remaining = int(length)
            self._state = _LENGTH if self._remaining else _DONE_LENGTH
        else:
            self._state, self._keep_alive = _UNTIL_CLOSE, False
        assert self.sink is not None
        self.sink.head_ready(status)
