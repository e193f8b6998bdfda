"""vLLM's --kv-transfer-config for KVTransferSettings: the fields vLLM really has, and our extra config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import SerializerFunctionWrapHandler, model_serializer

from dllm_contract.settings import (
    DEFAULT_HOLD_SECONDS,
    DEFAULT_PREFILL_WAIT_MS,
    Connector,
    KVTransferSettings,
    KVTransferShared,
    Role,
)
from dllm_contract.types import PositiveInt

# vLLM's kv_role for each of our roles.
VLLM_KV_ROLE: Mapping[Role, str] = {
    Role.PREFILL: "kv_producer",
    Role.DECODE: "kv_consumer",
    Role.BOTH: "kv_both",
}

# This project's vLLM connector classes (dllm_connector.connector), one per transport.
CONNECTOR_MODULE = "dllm_connector.connector"
CONNECTOR_CLASS: Mapping[Connector, str] = {
    Connector.MOONCAKE: "DllmMooncakeConnector",
    Connector.PYNCCL: "DllmNcclConnector",
}


# Fields left out of the extra config's JSON while unset.
_OMITTED_UNSET = ("transfer_ports", "peer_tp_size")


class ConnectorExtraConfig(KVTransferShared):
    """kv_connector_extra_config of this project's connectors: the settings vLLM has no field for.

    Strict (unknown keys and bad values are refused at engine start), because vLLM itself accepts any
    extra config. Its fields are the settings' own (KVTransferShared); the two only one role uses always
    have the contract's default here, so a bare instance is an engine whose CR sets no KV setting.
    """

    prefill_wait_ms: PositiveInt = DEFAULT_PREFILL_WAIT_MS
    hold_seconds: PositiveInt = DEFAULT_HOLD_SECONDS

    @model_serializer(mode="wrap")
    def _omit_unset_newer_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        for name in _OMITTED_UNSET:  # engines rendered before these existed print as they did
            if dumped.get(name, ()) is None:
                del dumped[name]
        return dumped


def extra_config(settings: KVTransferSettings) -> ConnectorExtraConfig:
    """The kv_connector_extra_config of this project's connectors for these settings: the fields both
    models have, where the settings set them (an unset one takes the extra config's default)."""
    shared = set(ConnectorExtraConfig.model_fields) & set(KVTransferSettings.model_fields)
    return ConnectorExtraConfig.model_validate(settings.model_dump(include=shared, exclude_none=True))


def kv_transfer_config(settings: KVTransferSettings, engine_id: str) -> dict[str, Any]:
    """vLLM's KVTransferConfig as a dict, with only the fields vLLM really has."""
    config: dict[str, Any] = {
        "kv_role": VLLM_KV_ROLE[settings.role],
        "kv_port": settings.listen_port,
        "engine_id": engine_id,
        "kv_load_failure_policy": settings.load_failure_policy.value,
    }
    if settings.custom is not None:
        config["kv_connector"] = settings.custom.connector_class
        if settings.custom.module_path:
            config["kv_connector_module_path"] = settings.custom.module_path
        config["kv_connector_extra_config"] = dict(settings.custom.extra_config)
    else:
        config["kv_connector"] = CONNECTOR_CLASS[settings.connector]
        config["kv_connector_module_path"] = CONNECTOR_MODULE
        config["kv_connector_extra_config"] = extra_config(settings).model_dump(mode="json")
    return config
