"""One Mooncake engine's entries in flight stay within what it handles (2048 in Mooncake 0.3.14): past
it, every batch then in flight failed, so a prefill engine serving a few long zero-copy transfers at once
failed them all. Writes wait for room instead. And the writes run on threads the transport keeps, not on
one started per write (gpu-review item 12)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from dllm_connector.transport import mooncake
from dllm_connector.transport.base import Span, TransportError
from dllm_connector.transport.entry_budget import MOONCAKE_ENTRIES_IN_FLIGHT, EntryBudget
from dllm_connector.transport.mooncake import MooncakeTransport

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

HOST = "127.0.0.1"
ENTRY_BYTES = 256
ENTRIES_PER_WRITE = 1024  # the transport's batch
WRITERS = 4  # 4096 entries at once: twice what the engine takes
CALLS = 2


def test_a_budget_waits_for_room_and_gives_up_at_its_deadline() -> None:
    budget = EntryBudget(10)
    assert budget.acquire(6, time.monotonic() + 1)
    assert not budget.acquire(5, time.monotonic() + 0.05)  # 4 free
    released = threading.Timer(0.05, budget.release, args=(6,))
    released.start()
    assert budget.acquire(10, time.monotonic() + 10)  # waits for the release
    assert budget.in_use == 10
    budget.release(10)
    assert budget.in_use == 0
    with pytest.raises(ValueError, match=r"1\.\.10"):
        budget.acquire(11, time.monotonic() + 1)


@pytest.fixture
def pair() -> Iterator[tuple[MooncakeTransport, MooncakeTransport]]:
    source, target = MooncakeTransport(HOST), MooncakeTransport(HOST)
    yield source, target
    source.close()
    target.close()


def test_writers_sharing_an_engine_past_its_limit_all_land(
    pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    source, target = pair
    total = WRITERS * CALLS * ENTRIES_PER_WRITE * ENTRY_BYTES
    sent = torch.randint(0, 255, (total,), dtype=torch.uint8)
    landed = torch.zeros_like(sent)
    source.register(sent)
    target.register(landed)
    peer = {"session": target.session_id}
    errors: list[BaseException] = []
    peak = [0]
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            peak[0] = max(peak[0], source.entries.in_use)
            watching.wait(0.0005)

    def write(writer: int) -> None:
        for call in range(CALLS):
            first = (writer * CALLS + call) * ENTRIES_PER_WRITE
            offsets = [(first + n) * ENTRY_BYTES for n in range(ENTRIES_PER_WRITE)]
            src = [Span(sent.data_ptr() + offset, ENTRY_BYTES) for offset in offsets]
            dst = [Span(landed.data_ptr() + offset, ENTRY_BYTES) for offset in offsets]
            try:
                source.send(peer, src, dst, 0, 60)
            except BaseException as error:  # noqa: BLE001 - collected for the assertion
                errors.append(error)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=write, args=(writer,)) for writer in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    watching.set()
    watcher.join(5)
    assert errors == []
    assert torch.equal(landed, sent)
    assert 0 < peak[0] <= MOONCAKE_ENTRIES_IN_FLIGHT
    assert source.entries.in_use == 0


def test_writes_one_after_another_reuse_the_transports_threads_and_a_closed_one_refuses(
    pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hundred writes run on no more threads than the transport keeps (a thread per write would be a
    hundred), each lands, and a send after close() fails with a TransportError saying so."""
    source, target = pair
    writes, size = 100, 4096
    sent = torch.randint(0, 255, (writes * size,), dtype=torch.uint8)
    landed = torch.zeros_like(sent)
    source.register(sent)
    target.register(landed)
    ran_on: list[threading.Thread] = []  # kept alive, so no two are the same object
    write = source._write

    def recording_spy(*args: object, **kwargs: object) -> int:
        ran_on.append(threading.current_thread())
        return write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(source, "_write", recording_spy)
    peer = {"session": target.session_id}
    for n in range(writes):
        span = [Span(sent.data_ptr() + n * size, size)], [Span(landed.data_ptr() + n * size, size)]
        source.send(peer, span[0], span[1], 0, 30)
    assert torch.equal(landed, sent)
    assert len(ran_on) == writes
    assert len({id(thread) for thread in ran_on}) <= mooncake._WRITERS
    source.close()
    with pytest.raises(TransportError, match="the transport closed"):
        source.send(peer, [Span(sent.data_ptr(), size)], [Span(landed.data_ptr(), size)], 0, 30)
