"""A raw HTTP/1.1 client for the router tests: requests written byte for byte, answers parsed."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass

from router_harness import WAIT_S, RunningRouter

from dllm_router.openai import COMPLETIONS


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class RawClient:
    """One TCP connection; requests written as given, answers parsed (Content-Length or chunked)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, r: RunningRouter | int, rcvbuf: int | None = None) -> RawClient:
        """Connect; `rcvbuf` shrinks the socket's receive buffer first (a client that barely reads)."""
        port = r if isinstance(r, int) else int(r.url.rsplit(":", 1)[1])
        if rcvbuf is None:
            return cls(*await asyncio.open_connection("127.0.0.1", port))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return cls(*await asyncio.open_connection(sock=sock))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def head(self) -> tuple[int, dict[str, str]]:
        async with asyncio.timeout(WAIT_S):
            status_line = await self.reader.readuntil(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 "), status_line
            headers: dict[str, str] = {}
            while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers

    async def chunk(self) -> bytes:
        """One piece of a chunked body (b"" for the last)."""
        async with asyncio.timeout(WAIT_S):
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
        assert data.endswith(b"\r\n")
        return data[:-2]

    async def answer(self) -> Answer:
        status, headers = await self.head()
        if headers.get("transfer-encoding") == "chunked":
            pieces = []
            while piece := await self.chunk():
                pieces.append(piece)
            body = b"".join(pieces)
        else:
            async with asyncio.timeout(WAIT_S):
                body = await self.reader.readexactly(int(headers["content-length"]))
        return Answer(status, headers, body)

    async def closed_by_server(self) -> bool:
        async with asyncio.timeout(WAIT_S):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


def post(body: bytes, *, path: str = COMPLETIONS, extra: bytes = b"") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%b\r\n%b" % (path.encode(), len(body), extra, body)
    )


def completion(prompt: str, tokens: int = 2, **more: object) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": tokens, **more}).encode()
