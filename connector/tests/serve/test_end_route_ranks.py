"""When decode's side channel does not answer, POST /v1/dllm/end_transfer is a 502 naming each TP rank
it could not reach, within the transfer timeout; the ranks that listen are still told.

The ranks that do not answer are ports held bound and not listening, so a connection is refused and no
other server takes them meanwhile; a rank that listens is a real KVReceiver over Mooncake
(end_route_cases.py).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import end_route_cases
import httpx
import pytest
from e2e.ports import free_consecutive_ports
from end_route_cases import (
    GEOMETRY,
    HOST,
    NUM_BLOCKS,
    TID,
    TIMEOUT,
    TOKEN,
    FakeEngineApp,
    authorized,
    caches,
    end_target,
    pipe_config,
    send_outcome,
    waiting_send,
)

from dllm_connector.end_route import END_PATH, EndTransferRoute
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.sidechannel import PeerAuth

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

transports = end_route_cases.transports  # the shared fixtures, collected from this module's names
sender = end_route_cases.sender


@pytest.fixture
def receiver(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVReceiver]:
    """Decode's rank 0 on the first of two ports outside the ephemeral range that were both free, so
    that rank 1's port is not some other test's listener (which would answer in its place)."""
    base = free_consecutive_ports(2)
    kv = PagedKV(caches(), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transports[0], kv, pipe_config(), HOST, base, auth=PeerAuth.from_token(TOKEN))
    yield receiver
    receiver.close()


@contextlib.contextmanager
def _bound_not_listening(port: int) -> Iterator[bool]:
    """Holds `port` bound without listening, so a connection to it is refused and no other server can
    take it meanwhile; yields False where it is already taken."""
    with socket.socket() as holder:
        try:
            holder.bind((HOST, port))
        except OSError:
            yield False
            return
        yield True


@contextlib.contextmanager
def _two_refusing_ports() -> Iterator[int]:
    """The first of two consecutive ports held bound and not listening (TP ranks 0 and 1)."""
    while True:
        with socket.socket() as first:
            first.bind((HOST, 0))
            port = int(first.getsockname()[1])
            with _bound_not_listening(port + 1) as held:
                if held:
                    yield port
                    return


async def test_a_side_channel_that_does_not_answer_is_a_502_naming_the_rank() -> None:
    with _two_refusing_ports() as port:
        app = EndTransferRoute(FakeEngineApp(), end_target(port, tp_size=2))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
            started = time.monotonic()
            answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=authorized())
    assert answer.status_code == 502
    message = answer.json()["error"]["message"]
    assert "rank 0: cannot end transfer" in message
    assert "rank 1: cannot end transfer" in message
    assert time.monotonic() - started < 3 * TIMEOUT


async def test_every_tp_rank_is_told(receiver: KVReceiver, sender: KVSender) -> None:
    """TP 2 where only rank 0 listens: rank 0's send ends, and the 502 names rank 1 alone."""
    app = EndTransferRoute(FakeEngineApp(), end_target(receiver.port, tp_size=2))
    with _bound_not_listening(receiver.port + 1) as held:
        assert held, f"port {receiver.port + 1}, free a moment ago, was taken meanwhile"
        await waiting_send(sender, receiver, TID)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client:
            answer = await client.post(END_PATH, json={"transfer_id": TID}, headers=authorized())
    message = answer.json()["error"]["message"]
    assert "rank 1: cannot end transfer" in message
    assert "rank 0" not in message
    assert "not awaited any more" in str(await send_outcome(sender, TID, 3 * TIMEOUT))
