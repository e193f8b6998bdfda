"""Do library HTTP servers hold the router's abuse limits? The raw-socket cases of the router's own tests
(router/tests/test_router_abuse.py, test_router_http_limits.py), against `dllm-router` and
against the same Router behind uvicorn and granian (bench/router_asgi.py, the router's limits mapped
onto each library's knobs where it has one).

Each server runs as in test_router_abuse.py: --max-connections 24, --head-timeout-s 1, --body-timeout-s 3,
engines at a port that refuses connections (nothing here reaches an engine). Per case it prints what
the client saw, how long it took and how much the server's resident memory grew (its process tree),
and whether the limit held as the router's tests require.

    .venv/bin/python bench/http_abuse.py [--servers router,uvicorn,granian,granian-rsgi]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.ports import free_port
from router import ASGI_APP, LIBRARY_SERVERS, ROOT, ensure_library_servers, tree_pids, wait_http

MAX_CONNECTIONS = 24
HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
GRACE_S = 4.0  # the router's tests allow a deadline this much lateness on a loaded machine
MIB = 1024 * 1024
Case = Callable[[int, list[int]], Awaitable[tuple[bool, str]]]


class Client:
    """One raw TCP connection: bytes written as given; the answer's status line, or how it ended."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, port: int, rcvbuf: int | None = None) -> Client:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return cls(*await asyncio.open_connection(sock=sock))

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def status(self, within_s: float) -> int | str:
        """The answer's status code; "closed" when the server closed first; "none" when nothing came."""
        try:
            async with asyncio.timeout(within_s):
                line = await self.reader.readline()
        except TimeoutError:
            return "none"
        except ConnectionError:
            return "closed"
        if not line:
            return "closed"
        return int(line.split()[1])

    async def answer(self, within_s: float) -> tuple[int | str, bytes]:
        """Status and body (Content-Length framing) of one whole answer."""
        status = await self.status(within_s)
        if not isinstance(status, int):
            return status, b""
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def closed_by_server(self, within_s: float) -> bool:
        try:
            async with asyncio.timeout(within_s):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        return True

    def close(self) -> None:
        self.writer.close()


def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        found = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
        total += int(found.group(1)) * 1024 if found else 0
    return total


async def trickle(c: Client, data: bytes, every_s: float) -> None:
    """A slowloris client: one byte per `every_s` (the behaviour under test)."""
    for i in range(len(data)):
        c.send(data[i : i + 1])
        await asyncio.sleep(every_s)


# ---- the cases (each returns: held as the router's tests require, and what was seen) ----


async def unterminated_header(port: int, pids: list[int]) -> tuple[bool, str]:
    """H1: 4 MiB of one header line that never ends: 431 and close, in bounded memory (three tries:
    a server that closes without lingering resets the connection before the client reads its 431)."""
    before = rss(pids)
    seen, took = [], 0.0
    for _ in range(3):
        c = await Client.to(port)
        started = time.monotonic()
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX: ")
        piece = b"a" * 65536
        for _ in range(64):
            c.send(piece)
        seen.append(await c.status(10.0))
        took = max(took, time.monotonic() - started)
        c.close()
    grew = (rss(pids) - before) / MIB
    held = seen == [431] * 3 and grew < 4
    return held, f"{'/'.join(map(str, seen))} within {took:.2f} s, RSS +{grew:.1f} MiB"


async def slowloris(port: int, _: list[int]) -> tuple[bool, str]:
    """M1: 12 heads trickled a byte per 50 ms: 408 (or a close) at the head deadline."""
    clients = [await Client.to(port) for _ in range(MAX_CONNECTIONS // 2)]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: " + b"s" * 10_000
    started = time.monotonic()
    slow = [asyncio.ensure_future(trickle(c, head, 0.05)) for c in clients]
    try:
        seen = await asyncio.gather(*(c.status(HEAD_TIMEOUT_S + GRACE_S + 2) for c in clients))
    finally:
        for task in slow:
            task.cancel()
        for c in clients:
            c.close()
    took = time.monotonic() - started
    held = all(s in (408, "closed") for s in seen) and took <= HEAD_TIMEOUT_S + GRACE_S
    return held, f"{'/'.join(sorted({str(s) for s in seen}))} after {took:.1f} s"


async def slow_body(port: int, _: list[int]) -> tuple[bool, str]:
    """M1: a body trickled a byte per 50 ms: 408 (or a close) at the body deadline."""
    c = await Client.to(port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100000\r\n\r\n")
    started = time.monotonic()
    slow = asyncio.ensure_future(trickle(c, b"b" * 10_000, 0.05))
    try:
        status = await c.status(BODY_TIMEOUT_S + GRACE_S + 2)
    finally:
        slow.cancel()
        c.close()
    took = time.monotonic() - started
    held = status in (408, "closed") and took <= BODY_TIMEOUT_S + GRACE_S
    return held, f"{status} after {took:.1f} s"


async def connection_cap(port: int, _: list[int]) -> tuple[bool, str]:
    """M1: with 24 connections open (each answered once), number 25 gets 503 and a close."""
    held = [await Client.to(port) for _ in range(MAX_CONNECTIONS)]
    try:
        for c in held:
            c.send(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            await c.answer(10.0)
        extra = await Client.to(port)
        extra.send(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        status = await extra.status(5.0)
        closed = await extra.closed_by_server(5.0) if status != "closed" else True
        extra.close()
    finally:
        for c in held:
            c.close()
    ok = status == 503 and closed
    return ok, f"connection 25: {status}, {'closed' if closed else 'left open'}"


async def pipelining(port: int, pids: list[int]) -> tuple[bool, str]:
    """H3: 10,000 pipelined requests from a client that does not read: the server holds back."""
    before = rss(pids)
    c = await Client.to(port, rcvbuf=16384)
    c.send(b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n" * 10_000)
    await idle(pids)
    grew = (rss(pids) - before) / MIB
    answered = 0
    try:
        async with asyncio.timeout(60):
            for _ in range(10_000):
                status, _ = await c.answer(10.0)
                answered += status == 200
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    c.close()
    return grew < 8 and answered == 10_000, f"RSS +{grew:.1f} MiB held, {answered} of 10000 answered"


async def idle(pids: list[int]) -> None:
    """Wait until the server uses no CPU across 0.2 s: what it was going to make, it has made."""

    def ticks() -> int:
        total = 0
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total

    last = -1
    async with asyncio.timeout(30):
        while (now := ticks()) != last:
            last = now
            await asyncio.sleep(0.2)  # the interval CPU time is compared over


CASES: dict[str, Case] = {
    "unterminated header (H1)": unterminated_header,
    "slowloris heads (M1)": slowloris,
    "slow body (M1)": slow_body,
    "connection cap (M1)": connection_cap,
    "pipelining, no reading (H3)": pipelining,
}


def start(server: str, port: int, engine: str) -> subprocess.Popen[bytes]:
    flags = [
        "--flow", "dllm", "--prefill-url", engine, "--decode-url", engine, "--log-level", "warning",
        "--max-connections", str(MAX_CONNECTIONS), "--head-timeout-s", str(HEAD_TIMEOUT_S),
        "--body-timeout-s", str(BODY_TIMEOUT_S), "--health-interval-s", "60",
    ]  # fmt: skip
    if server == "router":
        cmd = [sys.executable, "-m", "dllm_router", "--host", "127.0.0.1", "--port", str(port)]
        cmd += flags
    else:
        cmd = [sys.executable, str(ASGI_APP), server, str(port), "--", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def probe(server: str, engine: str) -> dict[str, tuple[bool, str]]:
    port = free_port()
    process = start(server, port, engine)
    try:
        await wait_http(f"http://127.0.0.1:{port}", "/health", 30.0)
        pids = tree_pids(process.pid)
        found = {}
        for name, case in CASES.items():
            try:
                found[name] = await case(port, pids)
            except Exception as e:  # noqa: BLE001  # a case that broke the client is a finding too
                found[name] = (False, f"probe failed: {e!r}"[:60])
            await asyncio.sleep(2.5)  # connections lingering after a refusal go (the router: 2 s)
        return found
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(("router", *LIBRARY_SERVERS)))
    servers = ap.parse_args().servers.split(",")
    if any(s != "router" for s in servers):
        ensure_library_servers()
    with socket.socket() as nobody:  # bound, never listening: engine calls are refused at once
        nobody.bind(("127.0.0.1", 0))
        engine = f"http://127.0.0.1:{nobody.getsockname()[1]}"
        results = {s: asyncio.run(probe(s, engine)) for s in servers}
    for name in CASES:
        print(name)
        for s in servers:
            held, seen = results[s][name]
            print(f"  {s:<14}{'holds' if held else 'FAILS':<7}{seen}")


if __name__ == "__main__":
    main()
