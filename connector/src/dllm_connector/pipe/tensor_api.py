"""The seed's tensor API: `send_kv_cache(id, kv, metadata)` and `receive_kv_cache(id, timeout)`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dllm_connector import codec
from dllm_connector.layout import Geometry, PagedKV
from dllm_connector.pipe.common import PipeConfig, gb
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.transport.base import Transport


class KVPipe:
    """send_kv_cache(request_id, kv, metadata) -> bool and receive_kv_cache(request_id, timeout).

    A whole KV tensor (any shape; its leading axis counts as blocks) moves as one transfer, keyed by
    request id. The receiving end is made for a tensor like the ones it will receive.
    """

    def __init__(self, transport: Transport, config: PipeConfig, *, host: str, port: int) -> None:
        self.transport = transport
        self.config = config
        self.host = host
        self.port = port

    def send_kv_cache(self, request_id: str, kv: torch.Tensor, metadata: Mapping[str, Any]) -> bool:
        """Push `kv` to metadata's peer ({"host", "port"}); True once decode verified and loaded it."""
        paged = _single_tensor_kv(kv)
        shape = paged.batch_shape(kv.shape[0])
        staging = codec.payload_nbytes(self.config.compression, kv.dtype, shape, paged.layout.groups)
        config = self.config.with_extra(async_transfer=False, buffer_size_gb=gb(staging + 64))
        sender = KVSender(self.transport, paged, config)
        job = SendJob(request_id, tuple(range(kv.shape[0])), str(metadata["host"]), int(metadata["port"]))
        try:
            sender.submit(job)
        finally:
            sender.close()
        return sender.finished().get(request_id, "missing") is None

    def receiver_for(self, like: torch.Tensor) -> _TensorReceiver:
        return _TensorReceiver(self, like)


class _TensorReceiver:
    """Decode end of KVPipe: receive_kv_cache(request_id, timeout) -> tensor or None."""

    def __init__(self, pipe: KVPipe, like: torch.Tensor) -> None:
        self.buffer = torch.empty_like(like)
        self.kv = _single_tensor_kv(self.buffer)
        self.receiver = KVReceiver(pipe.transport, self.kv, pipe.config, pipe.host, pipe.port)

    def receive_kv_cache(self, request_id: str, timeout: float) -> torch.Tensor | None:
        self.receiver.expect(request_id, range(self.buffer.shape[0]))
        outcome = self.receiver.wait_for(request_id, timeout)
        if outcome is None:
            self.receiver.cancel(request_id)
            self.receiver.wait_for(request_id, 0)  # consume the cancellation
            return None
        return self.buffer.clone() if outcome == "" else None

    def close(self) -> None:
        self.receiver.close()


def _single_tensor_kv(kv: torch.Tensor) -> PagedKV:
    return PagedKV({"kv": kv}, kv.shape[0], Geometry(block_size=0, num_kv_heads=0, head_dim=0))
