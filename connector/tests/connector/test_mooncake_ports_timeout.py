"""Mooncake's listening ports stay in DLLM_KV_TRANSFER_PORTS, and a timed-out write returns only once
Mooncake let go of it (C2, H5). Real Mooncake engines over TCP on 127.0.0.1; ranges and timeouts are
per process in Mooncake, so each case that sets them runs in its own process (mooncake_peer.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peer_doubles import wait_until

from dllm_connector.transport.base import Span, TransferTimeout, TransportError
from dllm_connector.transport.mooncake import (
    MC_MIN_TIMEOUT_S,
    MooncakeTransport,
    configure_environment,
    mooncake_timeout_s,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

HOST = "127.0.0.1"
PEER = Path(__file__).with_name("mooncake_peer.py")


def _run(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(PEER), *args], capture_output=True, text=True, timeout=90, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def _free_range(size: int = 32) -> tuple[int, int]:
    """A range in 20000-29999 (outside the ephemeral ports); Mooncake retries ports that are taken."""
    low = random.randrange(20000, 30000 - size)
    return low, low + size - 1


def test_both_listening_ports_of_each_engine_lie_in_the_declared_range() -> None:
    low, high = _free_range()
    seen = _run("ports", str(low), str(high))
    assert seen["equal"]
    assert all(low <= int(session.rsplit(":", 1)[1]) <= high for session in seen["sessions"])
    # Two engines, each an RPC (handshake) port and a TCP data port, and nothing else.
    assert len(seen["listening"]) == 4, seen["listening"]
    assert all(low <= port <= high for port in seen["listening"]), seen["listening"]


def test_a_range_set_after_mooncake_started_in_the_process_is_refused() -> None:
    low, high = _free_range()
    seen = _run("late-range", str(low), str(high))
    assert seen["error"] is not None
    assert f"outside {low}-{high}" in seen["error"]
    assert "once per process" in seen["error"]


@pytest.mark.parametrize(
    ("ports", "words"),
    [((40000, 40100), "32768-60999"), ((80, 90), "1024"), ((20000, 20000), "at least 2 ports")],
)
def test_a_range_mooncake_would_ignore_is_refused_before_it_is_set(
    monkeypatch: pytest.MonkeyPatch, ports: tuple[int, int], words: str
) -> None:
    monkeypatch.delenv("MC_MIN_RPC_PORT", raising=False)
    monkeypatch.delenv("MC_MAX_RPC_PORT", raising=False)
    with pytest.raises(TransportError, match=words):
        configure_environment(bind_host=None, rpc_ports=ports, timeout_s=None)
    assert "MC_MIN_RPC_PORT" not in os.environ


@pytest.mark.parametrize(
    ("timeout_s", "expected"), [(None, str(MC_MIN_TIMEOUT_S)), (1.0, "5"), (5.0, "5"), (12.9, "12")]
)
def test_mooncakes_timeout_is_no_longer_than_the_callers(
    monkeypatch: pytest.MonkeyPatch, timeout_s: float | None, expected: str
) -> None:
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    configure_environment(bind_host=None, rpc_ports=None, timeout_s=timeout_s)
    assert os.environ["MC_TRANSFER_TIMEOUT"] == expected


def test_the_timeout_mooncake_applies_is_read_as_mooncake_reads_it() -> None:
    assert mooncake_timeout_s({}) == 30
    assert mooncake_timeout_s({"MC_TRANSFER_TIMEOUT": "2"}) == 5
    assert mooncake_timeout_s({"MC_TRANSFER_TIMEOUT": " 12s"}) == 12
    assert mooncake_timeout_s({"MC_TRANSFER_TIMEOUT": "soon"}) == 5


class Peer:
    """A Mooncake engine in its own process (mooncake_peer.py peer)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PEER), "peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        self.info: dict[str, Any] = json.loads(self.process.stdout.readline())

    def landed(self) -> dict[str, int]:
        """Stops the peer; how many bytes of its buffers hold what the test wrote."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.close()
        landed: dict[str, int] = json.loads(self.process.stdout.readline())
        self.process.wait(30)
        return landed


@pytest.fixture
def peer() -> Iterator[Peer]:
    started = Peer()
    yield started
    if started.process.poll() is None:
        os.kill(started.process.pid, signal.SIGCONT)
        started.process.kill()
        started.process.wait(30)


@pytest.fixture(scope="module")
def local() -> Iterator[MooncakeTransport]:
    engine = MooncakeTransport(HOST, timeout_s=1.0)
    yield engine
    engine.close()


def _sevens(local: MooncakeTransport, nbytes: int) -> torch.Tensor:
    src = torch.full((nbytes,), 7, dtype=torch.uint8)
    local.register(src)
    return src


def test_the_peer_refuses_writes_outside_its_registered_memory(local: MooncakeTransport, peer: Peer) -> None:
    src = _sevens(local, 4096)
    with pytest.raises(TransportError, match="failed"):
        local.send({"session": peer.info["session"]}, [src], [Span(peer.info["unregistered"], 4096)], 0, 10)
    local.send({"session": peer.info["session"]}, [src], [Span(peer.info["registered"], 4096)], 0, 10)
    assert peer.landed() == {"registered": 4096, "unregistered": 0}


def _threads_stopped(pid: int) -> bool:
    try:
        stats = [(task / "stat").read_text() for task in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:  # a thread ended while read
        return False
    return all(stat.rsplit(")", 1)[1].split()[0] in ("T", "t") for stat in stats)


def _stop(process: subprocess.Popen[str]) -> None:
    """SIGSTOP the peer, then wait until every thread of it stands still: the signal lands in its own
    time, and a thread still running could take one more write and answer it."""
    os.kill(process.pid, signal.SIGSTOP)
    assert wait_until(lambda: _threads_stopped(process.pid), 10), "the peer's threads did not stop"


class _Watched:
    """The transport's Mooncake engine, its writes counted while they run and their statuses recorded
    as they return."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.statuses, self.failed = engine, list[int](), threading.Event()
        self.running = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # registering memory and the rest: the engine's own
        return getattr(self.engine, name)

    def batch_transfer_sync_write(self, *args: Any) -> int:
        with self._lock:
            self.running += 1
        try:
            status = int(self.engine.batch_transfer_sync_write(*args))
        finally:
            with self._lock:
                self.running -= 1
        self.statuses.append(status)
        if status != 0:
            self.failed.set()
        return status


@pytest.fixture
def watched(local: MooncakeTransport) -> Iterator[_Watched]:
    watching = _Watched(local._engine)
    local._engine = watching
    yield watching
    local._engine = watching.engine


def test_a_timed_out_write_returns_only_after_mooncake_gave_up(
    local: MooncakeTransport, peer: Peer, watched: _Watched
) -> None:
    src = _sevens(local, 1 << 20)
    session = peer.info["session"]
    local.send({"session": session}, [src[:16]], [Span(peer.info["registered"], 16)], 0, 10)  # connected
    _stop(peer.process)  # the peer stalls: Mooncake's write cannot complete
    started = time.monotonic()
    # 64 MiB (its 1 MiB buffer, 64 times over): more than the kernel's socket buffers can take in
    # (tcp_rmem/tcp_wmem autotune to MBs), so the write cannot end while the peer is stopped; 1 MiB once
    # fitted in them now and then, and the write finished.
    dst = [Span(peer.info["registered"], 1 << 20)] * 64
    with pytest.raises(TransferTimeout):
        local.send({"session": session}, [src] * len(dst), dst, 0, 1.0)
    elapsed = time.monotonic() - started
    assert watched.running == 0  # Mooncake's call returned: it no longer reads our memory
    assert watched.statuses[-1] != 0
    assert MC_MIN_TIMEOUT_S - 0.5 <= elapsed <= local.call_bound_s(dst) + 5
    os.kill(peer.process.pid, signal.SIGCONT)
    # What remains (documented): bytes already in the kernel still land once the peer resumes.
    assert peer.landed()["registered"] > 16


def test_a_peer_that_stood_still_past_mooncakes_bound_then_resumed_gets_the_write_within_the_deadline(
    local: MooncakeTransport, peer: Peer, watched: _Watched
) -> None:
    """A whole node froze for 30 s during a roll, past Mooncake's own bound: the write failed although
    the transfer's deadline had time left. Mooncake gives up on the stopped peer (its 5 s here); the
    peer resumes; the batch written again lands, and the send succeeds within its deadline."""
    src = _sevens(local, 4096)
    session = peer.info["session"]
    local.send({"session": session}, [src[:16]], [Span(peer.info["registered"], 16)], 0, 10)  # connected
    del watched.statuses[:]
    _stop(peer.process)
    result: list[BaseException | None] = []

    def send() -> None:
        try:
            local.send({"session": session}, [src], [Span(peer.info["registered"], 4096)], 0, 30)
            result.append(None)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            result.append(error)

    sender = threading.Thread(target=send)
    sender.start()
    gave_up = watched.failed.wait(20)
    os.kill(peer.process.pid, signal.SIGCONT)
    sender.join(30)
    assert gave_up, f"Mooncake never gave up on the stopped peer: statuses {watched.statuses}, {result}"
    assert result == [None], result
    assert watched.statuses[0] != 0
    assert watched.statuses[-1] == 0
    assert len(watched.statuses) == 2
    assert peer.landed()["registered"] == 4096
