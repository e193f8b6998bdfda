"""torch.distributed pairs join only the store their side-channel peer named, and are bounded (M7).

Real gloo pair groups on 127.0.0.1, sender and receiver transports in this process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dllm_connector.transport.base import Span, TransferTimeout, TransportError
from dllm_connector.transport.torchdist import WATCHDOG_TIMEOUT, TorchDistTransport, store_address

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"


@pytest.mark.parametrize(
    ("store", "peer", "expected"),
    [
        ("127.0.0.1:4000", "127.0.0.1", ("127.0.0.1", 4000)),
        ("127.0.0.1:4000", "::ffff:127.0.0.1", ("127.0.0.1", 4000)),  # seen through a dual-stack socket
        ("[::1]:4000", "::1", ("::1", 4000)),
    ],
)
def test_a_store_on_the_peers_own_address_is_admitted(
    store: str, peer: str, expected: tuple[str, int]
) -> None:
    assert store_address({"store": store}, peer) == expected


@pytest.mark.parametrize(
    ("store", "words"),
    [
        ("10.9.8.7:4000", "not on its side-channel peer 127.0.0.1"),
        ("metadata.google.internal:80", "not an IP address"),
        ("127.0.0.1:0", "HOST:PORT"),
        ("127.0.0.1:99999", "HOST:PORT"),
        ("127.0.0.1", "HOST:PORT"),
        (None, "names no TCPStore"),
        ("1" * 10_000, "names no TCPStore"),
    ],
)
def test_any_other_store_is_refused(store: object, words: str) -> None:
    with pytest.raises(TransportError, match=words) as refused:
        store_address({"store": store}, HOST)
    assert len(str(refused.value)) < 400


Pair = tuple[TorchDistTransport, TorchDistTransport]  # (sender, receiver)


@pytest.fixture
def pair() -> Iterator[Pair]:
    sender = TorchDistTransport(HOST, backend="gloo", connect_timeout=10, max_groups=2)
    receiver = TorchDistTransport(
        HOST, backend="gloo", connect_timeout=10, max_groups=2, require_admission=True
    )
    yield sender, receiver
    sender.close()
    receiver.close()


def _offer(sender: TorchDistTransport, node: str) -> dict[str, Any]:
    return {**sender.endpoint(), "pair": sender.pair_key(node)}


def _move(sender: TorchDistTransport, receiver: TorchDistTransport, peer: dict[str, Any], tag: int) -> None:
    """One tensor from sender to receiver through their pair group; raises what either side raised."""
    src = torch.arange(64, dtype=torch.float32) + tag
    dst = torch.zeros(64, dtype=torch.float32)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(peer, [src], [Span(0, src.numel() * 4)], tag, 10)
        except TransportError as error:
            errors.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        receiver.recv(peer, [dst], tag, 10)
    finally:
        thread.join(30)
    if errors:
        raise errors[0]
    assert torch.equal(src, dst)


def test_an_admitted_store_carries_the_transfer(pair: Pair) -> None:
    sender, receiver = pair
    offer = _offer(sender, "decode-a")
    receiver.admit(offer, HOST)
    _move(sender, receiver, offer, tag=1)


def test_a_store_not_admitted_is_never_joined(pair: Pair) -> None:
    sender, receiver = pair
    offer = {**_offer(sender, "decode-a"), "store": "10.9.8.7:4000"}  # would hang for the timeout
    with pytest.raises(TransportError, match="not on its side-channel peer"):
        receiver.admit(offer, HOST)
    started = time.monotonic()
    with pytest.raises(TransportError, match="no store was admitted"):
        receiver.recv(offer, [torch.zeros(4)], 1, 10)
    assert time.monotonic() - started < 1  # refused, not a connection attempt
    assert receiver.group_count == 0


def test_pair_groups_are_bounded_and_a_dropped_one_fails_fast(pair: Pair) -> None:
    sender, receiver = pair
    offers = [_offer(sender, f"decode-{name}") for name in "abc"]
    for tag, offer in enumerate(offers):
        receiver.admit(offer, HOST)
        _move(sender, receiver, offer, tag)
    assert receiver.group_count == 2
    assert sender.group_count == 2
    # The least recent pair (decode-a) was dropped on both sides: the receiver refuses its key at once
    # and the sender's next offer to that peer is a new generation.
    started = time.monotonic()
    with pytest.raises(TransportError, match="was dropped"):
        receiver.recv(offers[0], [torch.zeros(4)], 9, 10)
    assert time.monotonic() - started < 1
    again = _offer(sender, "decode-a")
    assert again["pair"] != offers[0]["pair"]
    receiver.admit(again, HOST)
    _move(sender, receiver, again, tag=7)


def test_a_pair_key_that_is_not_ours_is_refused(pair: Pair) -> None:
    _, receiver = pair
    with pytest.raises(TransportError, match="no valid pair key"):
        receiver.admit({"store": f"{HOST}:4000", "pair": "x" * 10_000}, HOST)
    with pytest.raises(TransportError, match="no valid pair key"):
        receiver.admit({"store": f"{HOST}:4000", "pair": ["list"]}, HOST)


class StalledWorkDouble:
    """torch's Work for an operation whose peer never comes: its wait times out."""

    def wait(self, timeout: object) -> None:
        raise RuntimeError(f"Work timed out after {timeout}")


class PairGroupDouble:
    """A pair group whose operations stall, recording its abort (gloo's and NCCL's groups have one)."""

    def __init__(self) -> None:
        self.aborted = 0

    def recv(self, tensors: object, rank: int, tag: int) -> StalledWorkDouble:
        return StalledWorkDouble()

    def abort(self) -> None:
        self.aborted += 1


def test_a_transfer_past_its_timeout_aborts_its_group_and_fails_only_itself(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu-review item 3: the transfer's timeout is the connector's, not the group's watchdog (which
    on NCCL tears the process down by default): a stalled transfer fails with TransferTimeout, its
    group is aborted and forgotten, and the next transfer makes a new one."""
    sender, receiver = pair
    offer = _offer(sender, "decode-a")
    receiver.admit(offer, HOST)
    stalled = PairGroupDouble()
    monkeypatch.setattr(receiver, "_new_group", lambda *args: stalled)
    with pytest.raises(TransferTimeout, match=r"ran past 0\.5s"):
        receiver.recv(offer, [torch.zeros(4)], 1, 0.5)
    assert stalled.aborted == 1
    assert receiver._groups == {}
    assert WATCHDOG_TIMEOUT.total_seconds() >= 600  # far above any transfer's timeout
