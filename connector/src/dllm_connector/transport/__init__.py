"""KV transports: one interface (base.Transport), Mooncake and torch.distributed implementations."""

from dllm_connector.transport.base import Span, TransferTimeout, Transport, TransportError
from dllm_connector.transport.staging import StagingBuffer

__all__ = ["Span", "StagingBuffer", "TransferTimeout", "Transport", "TransportError"]
