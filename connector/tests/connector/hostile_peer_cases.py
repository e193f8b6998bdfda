"""What the hostile-peer KV tests share: both sides' time limits, a real KVReceiver and KVSender on
the module's Mooncake transports, and a way to run one send to its outcome.

A test module collects `receiver` and `sender` by binding them to names of its own
(`receiver = hostile_peer_cases.receiver`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, pipe_config
from peer_doubles import wait_until

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.mooncake import MooncakeTransport

TIMEOUT_MS = 2000  # transfer_timeout_ms of both sides
TIMEOUT = TIMEOUT_MS / 1000
HOLD_SECONDS = 30  # hold_seconds: every bound below is far under it
HOLD = float(HOLD_SECONDS)
HASH = prompt_hash([1, 2, 3])


def config(**changes: Any) -> PipeConfig:
    base = {
        "buffer_size_gb": gb(16 << 20),
        "transfer_timeout_ms": TIMEOUT_MS,
        "prefill_wait_ms": HOLD_SECONDS * 1000,
        "hold_seconds": HOLD_SECONDS,
    }
    return pipe_config(**(base | changes))


@pytest.fixture
def receiver(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVReceiver]:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transports[0], kv, config(), HOST, 0)
    yield receiver
    receiver.close()
    assert receiver.staging.in_use == 0


@pytest.fixture
def sender(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[KVSender]:
    kv = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    sender = KVSender(transports[1], kv, config())
    yield sender
    assert sender.close(timeout=30)
    assert sender.staging.in_use == 0


def send_and_wait(sender: KVSender, job: SendJob, within: float) -> tuple[str | None, float]:
    """Submit `job`; its outcome and how long it took (fails the test past `within` seconds)."""
    started = time.monotonic()
    sender.submit(job)
    outcomes: dict[str, str | None] = {}
    assert wait_until(lambda: outcomes.update(sender.finished()) or job.transfer_id in outcomes, within)
    return outcomes[job.transfer_id], time.monotonic() - started
