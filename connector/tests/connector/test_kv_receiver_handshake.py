"""Decode's side channel gives a peer's hello as long as a quiet peer may take mid-transfer
(kvTransfer.timeoutMs), never less than the side channel's own 5 s: on the 2-core test host, whose whole
machine stalls for 10-20 s now and then, a hello that came 5 s late failed a stream of a roll under load
(the sample's timeoutMs is 40 s for those stalls)."""

from __future__ import annotations

import pytest
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, receiver_config

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.transport import sidechannel
from dllm_connector.transport.mooncake import MooncakeTransport

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("timeout_ms", "handshake_s"), [(40_000, 40.0), (2_000, sidechannel.HANDSHAKE_TIMEOUT_S)]
)
def test_the_hello_waits_as_long_as_the_transfer_timeout_and_never_less_than_the_default(
    timeout_ms: int, handshake_s: float
) -> None:
    transport = MooncakeTransport(HOST)
    kv = PagedKV(make_caches(1), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transport, kv, receiver_config(transfer_timeout_ms=timeout_ms), HOST, 0)
    try:
        assert receiver.handshake_timeout_s == handshake_s
    finally:
        receiver.close()
        transport.close()
