"""What the KV data-path transfer tests share: the blocks sent and received, the error each codec
may leave, a decode side on a chosen path in this process, transfers at once from one sender to one
receiver, and how far a cache is from another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, receiver_config

from dllm_connector.layout import PagedKV
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.base import Transport
from dllm_connector.transport.placement import PathSetting
from dllm_contract.kvconfig import Compression

SRC_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))[:120]]
DST_BLOCKS = [int(b) for b in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(4))[:120]]
RELATIVE_ERROR = {Compression.NONE: 0.0, Compression.FP8: 0.04, Compression.INT8: 0.01}


def decode(transport: Transport, path: PathSetting, **changes: Any) -> tuple[KVReceiver, PagedKV]:
    kv = PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY)
    return KVReceiver(transport, kv, receiver_config(data_path=path, **changes), HOST, 0), kv


def deliver_all(
    sender: KVSender, receiver: KVReceiver, jobs: Mapping[str, tuple[Sequence[int], Sequence[int]]]
) -> None:
    """Each transfer id's (source blocks, destination blocks) expected and sent at once; every one
    delivered."""
    for transfer, (src, dst) in jobs.items():
        receiver.expect(transfer, tuple(dst))
        sender.submit(SendJob(transfer, tuple(src), HOST, receiver.port))
    assert [receiver.wait_for(transfer, 60) for transfer in jobs] == [""] * len(jobs)
    assert sender.wait_idle(30)
    assert set(sender.finished().values()) == {None}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())
