"""Decode telling a sender to stop (nack), and reading a part's messages so a stop is never late (H5)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

from dllm_connector.pipe.common import POLL_S, PipeConfig, PipeStats, readable, send
from dllm_connector.pipe.expectations import Part
from dllm_connector.pipe.messages import Nack, bounded
from dllm_connector.transport import sidechannel
from dllm_connector.transport.base import TransferTimeout, TransportError
from dllm_connector.transport.sidechannel import Message


class PartChannel:
    """The side-channel connection `sock` of a claimed `part`, from decode's side."""

    def __init__(self, sock: socket.socket, part: Part, config: PipeConfig, stats: PipeStats) -> None:
        self._sock = sock
        self.part = part
        self._config = config
        self._stats = stats

    def next_message(self) -> Message:
        """The sender's next message (within the transfer timeout). A failure of the load (a cancel,
        another part) is told to the sender before each message and while waiting, so that it stops
        writing into decode's memory at once (H5)."""
        timeout = self._config.transfer_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if self.part.expectation.failure:
                self.tell_to_stop(f"KV load failed: {self.part.expectation.failure}")
            if readable(self._sock, min(POLL_S, max(0.0, deadline - time.monotonic()))):
                return sidechannel.recv_message(self._sock, timeout)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"no side-channel message within {timeout:.1f}s")

    def tell_to_stop(self, reason: str) -> None:
        """Mid-stream, once: nack now, so the sender stops writing and answers with abort (H5)."""
        if not self.part.told_to_stop:
            self.part.told_to_stop = True
            send_nack(self._sock, reason)
            self._stats.stops_requested += 1

    def refuse_and_drain(self, reason: str, *, drain: bool, slow: bool = False) -> None:
        """Tell the sender; if it may still be writing, wait until it says it stopped (done or
        abort) or closes before decode's memory is handed on (H5). A sender that went quiet
        (`slow`: a write may hang in its transport) gets up to the hold time; one that broke the
        protocol, the transfer timeout."""
        send_nack(self._sock, reason)
        if not drain:
            return
        config = self._config
        wait = max(config.hold_s, config.transfer_timeout_s) if slow else config.transfer_timeout_s
        deadline = time.monotonic() + wait
        with contextlib.suppress(TransportError):
            while (left := deadline - time.monotonic()) > 0:
                if sidechannel.recv_message(self._sock, left)["type"] in ("done", "abort"):
                    return


@contextlib.contextmanager
def nack_on_error(sock: socket.socket) -> Iterator[None]:
    """Before the accept: a failure is told to the sender (best effort, bounded: L2), then raised."""
    try:
        yield
    except Exception as error:
        send_nack(sock, f"KV load failed: {getattr(error, 'peer_reason', error)}")
        raise


def send_nack(sock: socket.socket, reason: str) -> None:
    """`nack {reason}` to the sender, bounded; a broken connection is left to whoever reads it next."""
    with contextlib.suppress(TransportError):
        send(sock, Nack(type="nack", reason=bounded(reason)))
