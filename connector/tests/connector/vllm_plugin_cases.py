"""What the vLLM plugin tests share: our KV settings for a role, vLLM's config around them, and the
extra config our connectors read."""

from __future__ import annotations

from typing import Any

from kv_peer import HOST
from vllm.config import KVTransferConfig, VllmConfig

from dllm_contract.kvconfig import (
    Connector,
    ConnectorExtraConfig,
    KVTransferSettings,
    Role,
    kv_transfer_config,
)

BLOCK = 16


def settings(connector: Connector, role: Role, **changes: Any) -> KVTransferSettings:
    base: dict[str, Any] = {
        "connector": connector,
        "role": role,
        "listen_port": 14579,
        "buffer_size_gb": 0.01,
    }
    if role is Role.PREFILL:
        base |= {"decode_host": HOST, "decode_port": 14600}
    return KVTransferSettings(**(base | changes))


def vllm_config(transfer: dict[str, Any]) -> VllmConfig:
    config = VllmConfig(kv_transfer_config=KVTransferConfig(**transfer))
    config.cache_config.block_size = BLOCK
    return config


def extra(**changes: Any) -> ConnectorExtraConfig:
    base = kv_transfer_config(settings(Connector.MOONCAKE, Role.BOTH), "e")["kv_connector_extra_config"]
    return ConnectorExtraConfig.model_validate(base | {"transfer_threshold_tokens": 16} | changes)
