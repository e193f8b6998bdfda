"""KV transports: one interface (base.Transport), Mooncake and torch.distributed implementations."""

from dllm_connector.transport.base import RemoteRegion, TransferTimeout, Transport, TransportError
from dllm_connector.transport.staging import StagingBuffer

__all__ = ["RemoteRegion", "StagingBuffer", "TransferTimeout", "Transport", "TransportError"]
