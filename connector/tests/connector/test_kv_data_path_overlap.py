"""The pinned-host path overlaps its copies with the wire: while piece k is held on the wire, the
pieces after it are encoded and copied into host staging.

Real KVSender and KVReceiver over real Mooncake transports on 127.0.0.1, a CPU cache on the
pinned-host path (synchronous copies here; a side stream on CUDA). The wire is held by
GatedTransportDouble (peer_doubles.py), which wraps prefill's real transport.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, pipe_config
from peer_doubles import GatedTransportDouble, wait_until

from dllm_connector import codec
from dllm_connector.layout import PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.base import Source
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import DataPath, PathSetting
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

HASH = prompt_hash([7, 8])
SRC = tuple(range(20, 36))
DST = tuple(range(300, 316))


def config() -> PipeConfig:
    return pipe_config(
        compression=Compression.FP8,
        buffer_size_gb=gb(16 << 20),
        transfer_timeout_ms=10_000,
        prefill_wait_ms=30_000,
        hold_seconds=30,
        data_path=PathSetting.PINNED_HOST,
    )


class StagingWatchingSender(KVSender):
    """Test double: a real KVSender that records, as each piece goes to the writer, whether a watched
    range of its host staging holds any byte yet (the staging starts zeroed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watched: list[tuple[int, int]] = []
        self.seen: list[bool] = []

    def _before_write(self, index: int, src: Sequence[Source]) -> None:
        tensor = self.staging.tensor
        self.seen.append(any(bool(tensor[a:b].any()) for a, b in self.watched))


@pytest.fixture
def gated(transports: tuple[MooncakeTransport, MooncakeTransport]) -> Iterator[GatedTransportDouble]:
    double = GatedTransportDouble(transports[1])
    yield double
    double.open()


def test_later_pieces_are_copied_to_host_staging_while_the_first_is_on_the_wire(
    transports: tuple[MooncakeTransport, MooncakeTransport], gated: GatedTransportDouble
) -> None:
    source = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    sender = StagingWatchingSender(gated, source, config())
    sender.piece_bytes = 1  # a piece per layer
    sender.staging.tensor.zero_()
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    receiver = KVReceiver(transports[0], kv, config(), HOST, 0)
    assert sender.placement.path is receiver.placement.path is DataPath.PINNED_HOST
    # What the one batch's payload holds once encoded (the checksum's algorithm aside)
    header, want = codec.encode(source.gather(SRC), Compression.FP8, source.groups())
    per_layer = header.shape[0] // source.num_layers
    last_layer = header.ranges((source.num_layers - 1) * per_layer, per_layer)
    staging = sender.staging.tensor  # the batch is its first reservation: from offset 0
    sender.watched, sender.seen = last_layer, []
    try:
        receiver.expect("t-overlap", DST, prompt_hash=HASH)
        sender.submit(SendJob("t-overlap", SRC, HOST, receiver.port, HASH))
        assert wait_until(lambda: gated.waiting == 1, 10)  # the first piece is held on the wire
        assert sender.seen[0] is False  # it went before the last layer was even encoded
        assert wait_until(
            lambda: all(bool((staging[a:b] == want[a:b]).all()) for a, b in last_layer), 10
        )  # and the last layer is encoded and copied to host staging meanwhile
        assert gated.writes == []
        gated.open()
        assert receiver.wait_for("t-overlap", 30) == ""
        assert sender.wait_idle(10)
        assert sender.finished() == {"t-overlap": None}
        got, sent = kv.gather(DST), source.gather(SRC)
        assert float((got.float() - sent.float()).norm() / sent.float().norm()) < 0.04
        assert len(gated.writes) >= source.num_layers  # a write per piece
    finally:
        gated.open()
        sender.close()
        receiver.close()
    assert sender.staging.in_use == 0
    assert receiver.staging.in_use == 0
