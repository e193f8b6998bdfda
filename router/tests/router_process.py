"""The real `dllm-router` as a subprocess, run as the operator runs it (`python -m dllm_router`,
flags), with its memory and CPU read from /proc."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from raw_client import RawClient


@dataclass
class RouterProcess:
    process: subprocess.Popen[bytes]
    port: int

    def _status_kib(self, field: str) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(rf"^{field}:\s+(\d+) kB$", status, re.MULTILINE)
        assert match is not None
        return int(match.group(1))

    def rss(self) -> int:
        """Resident memory in bytes."""
        return self._status_kib("VmRSS") * 1024

    def peak_rss(self) -> int:
        """The highest resident memory since the router started, in bytes (VmHWM)."""
        return self._status_kib("VmHWM") * 1024

    async def client(self, rcvbuf: int | None = None) -> RawClient:
        return await RawClient.to(self.port, rcvbuf=rcvbuf)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_ticks(self) -> int:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    async def idle(self) -> None:
        """Wait until the router uses no CPU across 0.2 s: whatever it was going to do is done."""
        last = -1
        async with asyncio.timeout(20):
            while (now := self.cpu_ticks()) != last:
                last = now
                await asyncio.sleep(0.2)  # the interval CPU time is compared over

    async def open_connections(self) -> int:
        """The router's own count (its /metrics gauge), the asking connection included."""
        c = await self.client()
        c.send(b"GET /metrics HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
        page = (await c.answer()).body.decode()
        c.close()
        found = re.search(r"^dllm_router_open_connections (\d+)(?:\.0)?$", page, re.MULTILINE)
        assert found is not None
        return int(found.group(1))

    async def quiet(self) -> None:
        """Wait until earlier tests' connections (lingering after a refusal: 2 s) are gone."""
        async with asyncio.timeout(15):
            while await self.open_connections() > 1:
                pass


@contextmanager
def router_process(flags: list[str], log: Path) -> Iterator[RouterProcess]:
    """`dllm-router` on 127.0.0.1 and a free port with these flags, its log in `log`; on leaving it is
    terminated, and its log must hold no traceback and no ERROR line."""
    argv = [sys.executable, "-m", "dllm_router", "--host", "127.0.0.1", "--port", "0", *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stderr=out)
    try:
        yield RouterProcess(process, listening_port(process, log))
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = log.read_text()
    assert "Traceback" not in text
    assert " ERROR " not in text


def listening_port(process: subprocess.Popen[bytes], log: Path) -> int:
    """The port from the router's start line (it logs the bound port; --port 0 picks a free one)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"dllm-router on 127\.0\.0\.1:(\d+)", log.read_text())
        if found:
            return int(found.group(1))
        if process.poll() is not None:
            raise AssertionError(f"the router exited ({process.returncode}):\n{log.read_text()}")
        threading.Event().wait(0.05)  # the start line is a file's content: re-read until it is there
    raise AssertionError("the router did not log its port within 30 s")
