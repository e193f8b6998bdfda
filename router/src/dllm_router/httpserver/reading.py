"""How a connection reads: requests parsed by llhttp within their limits (head size H1, body size,
Content-Length, Expect), refused when over them, and reading held back while answers pile up or the
client does not read (H3)."""

from __future__ import annotations

import logging

import httptools

from dllm_router.http_messages import Request
from dllm_router.httpserver.limits import MAX_HEAD, MAX_PIPELINE
from dllm_router.httpserver.writing import WritingConnection

log = logging.getLogger("dllm_router.httpserver")  # one logger name for the whole server


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ReadingConnection(WritingConnection):
    """Requests in: fed to the parser piece by piece, queued for the answering side (connection.py)."""

    def _advance(self) -> None:
        """Start on the request at the head of the line: the answering side's (connection.py)."""
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: discard
        now = self.idle_since = self.loop.time()  # a head that stalls (no request queued yet) is swept too
        if self._unfed is not None:  # cannot happen while reading is paused; kept in order regardless
            raw, pos = self._unfed
            self._unfed = None
            data = raw[pos:] + data
        self._consume(data, 0, now)

    def _consume(self, raw: bytes, pos: int, now: float) -> None:
        """Feed `raw[pos:]` to the parser piece by piece: a head's bytes are counted before the parser
        sees them, and what follows a head or a declared body waits while reading is held back."""
        view = memoryview(raw)
        size = len(raw)
        while pos < size:
            if self._refused or self.closed:
                return
            if self._holding():
                self._unfed = (raw, pos)
                self._update_reading()
                return
            if self._in_body:
                left = self._body_left
                end = size if not left else min(size, pos + left)
            else:
                if self._head_began is None:
                    self._head_began = now
                budget = MAX_HEAD + 1 - self._head_bytes
                blank = raw.find(b"\r\n\r\n", pos, pos + budget + 3)
                end = min(size, pos + budget) if blank < 0 else blank + 4
            in_head = not self._in_body
            self._feed(view[pos:end])
            if in_head and self._head_began is not None and not self._refused:
                self._head_bytes += end - pos  # the head is still open: all of the piece was head
                if self._head_bytes > MAX_HEAD:
                    self._refuse(431, f"request head over {MAX_HEAD} bytes")
                    return
            pos = end

    def _feed(self, data: memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Refusal):
                self._refuse(cause.status, str(cause))
            else:
                log.exception("HTTP request callback failed")
                self._refuse(500, "internal error while reading the request")
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")

    # ---- reading, held back while answers pile up (H3) ----

    def _holding(self) -> bool:
        return self.write_paused or len(self._queue) > MAX_PIPELINE

    def _update_reading(self) -> None:
        """Pause reading while holding back; resume (after feeding what was held) once not."""
        if self.closed or self.transport is None:
            return
        if self._holding() and not self._refused:
            if not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()
        elif self._read_paused and not self._resuming:
            self._resuming = True
            self.loop.call_soon(self._resume_reading)  # never inside a parser callback

    def _resume_reading(self) -> None:
        self._resuming = False
        if self.closed or (self._holding() and not self._refused):
            return
        unfed, self._unfed = self._unfed, None
        if unfed is not None and not self._refused:
            self._consume(*unfed, self.loop.time())
        held = self._holding() and not self._refused
        if self._unfed is None and self._read_paused and not self.closed and not held:
            self._read_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    # ---- parser callbacks ----

    def on_message_begin(self) -> None:
        self._spoke = True
        self._current = Request(self)
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        assert self._current is not None
        self._current._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._count_head(len(name) + len(value))
        key = name.lower()
        headers = self._current.headers
        headers[key] = headers[key] + b", " + value if key in headers else value

    def on_headers_complete(self) -> None:
        request = self._current
        assert request is not None
        self._head_bytes, self._head_began = 0, None
        self._in_body, self._body_began = True, self.idle_since
        self.server.idle.pop(self, None)  # a request is in progress: never evicted (NEW-5)
        parser = self.parser
        request.method = parser.get_method().decode("ascii", errors="replace")
        request.keep_alive = parser.should_keep_alive()
        request.http10 = parser.get_http_version() == "1.0"
        path, _, query = request._url.partition(b"?")
        request.path = path.decode("latin-1")
        request.query = query.decode("latin-1")
        self._queue.append(request)
        self._update_reading()
        self._give_back_body()
        if self.server.body_ledger is not None:
            self._body_charge = self.server.body_ledger()
            self.server.uploads[self] = self.loop.time()
        length = request.headers.get(b"content-length")
        self._body_left = None
        if length is not None:
            declared = _length(length)
            if declared > self.server.max_body:
                raise _Refusal(413, self.server.too_large)
            if b"transfer-encoding" not in request.headers:
                self._body_left = declared
        expect = request.headers.get(b"expect")
        if expect is not None:
            if expect.lower() != b"100-continue":
                raise _Refusal(417, "only 'Expect: 100-continue' is supported")
            request.expect_continue = True
        self._advance()

    def on_body(self, body: bytes) -> None:
        request = self._current
        assert request is not None
        request._size += len(body)
        if self._body_left is not None:
            self._body_left -= len(body)
        if request._size > self.server.max_body:
            raise _Refusal(413, self.server.too_large)
        charge = self._body_charge
        if charge is not None:
            why = charge.try_charge_body(len(body))
            while why and self.server.evict_upload(self, why):
                why = charge.try_charge_body(len(body))
            if why:
                raise _Refusal(503, why)
        request._pieces.append(body)

    def on_message_complete(self) -> None:
        request = self._current
        assert request is not None
        self._current = None
        self._in_body, self._body_began, self._body_left = False, None, None
        pieces = request._pieces
        request.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        request._pieces = []
        request.complete = True
        self._give_back_body()  # whole now: its handler charges it (and holds it) from here
        self._advance()

    def refuse_upload(self, why: str) -> None:
        if not self._refused and not self.closed:
            self._refuse(503, f"{why}; this upload, the oldest in progress, was given up to make room")

    def _count_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > MAX_HEAD:
            raise _Refusal(431, f"request head over {MAX_HEAD} bytes")

    def _refuse(self, status: int, message: str) -> None:
        """Stop reading this connection; the refusal is answered in turn, then the connection closes."""
        self._refused = True
        self._give_back_body()
        if self._current is not None:
            self._current._pieces = []  # never read on: what was read of it is dropped now
        self.server.idle.pop(self, None)  # its refusal is answered first; lingering, it is idle again
        request = self._current
        if request is None or request not in self._queue:
            request = request or Request()
            self._queue.append(request)
        request.refusal = (status, message)
        self._advance()


def _length(value: bytes) -> int:
    try:
        return int(value)
    except ValueError:
        raise _Refusal(400, "bad Content-Length") from None
