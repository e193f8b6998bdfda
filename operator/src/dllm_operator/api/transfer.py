"""spec.kvTransfer and spec.rdma: how KV moves from prefill to decode."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from dllm_contract.kvconfig import (
    DEFAULT_BUFFER_SIZE_GB,
    DEFAULT_HOLD_SECONDS,
    DEFAULT_KV_PORT,
    DEFAULT_PREFILL_WAIT_MS,
    DEFAULT_TRANSFER_THRESHOLD_TOKENS,
    DEFAULT_TRANSFER_TIMEOUT_MS,
    Compression,
    Connector,
    LoadFailurePolicy,
)
from dllm_contract.types import Port, PositiveFloat, PositiveInt
from dllm_operator.api.common import (
    EMPTY_DEFAULT_IS_A_CHOICE,
    OPTED_IN,
    FreeForm,
    Name,
    _Model,
    cel,
    rules,
)

# ---- spec.kvTransfer, spec.rdma -------------------------------------------------------------------


class CustomConnectorSpec(_Model):
    connector_class: Annotated[
        str,
        Field(
            min_length=1,
            max_length=253,
            description="Class name: yours in modulePath, or a vLLM built-in such as NixlConnector or "
            "MooncakeConnector.",
        ),
    ]
    module_path: Annotated[
        str,
        Field(
            max_length=512,
            description="Python module that holds the class (vLLM kv_connector_module_path); empty for vLLM "
            "built-ins.",
        ),
    ] = ""
    extra_config: FreeForm = Field(
        default_factory=dict,
        description="Free-form kv_connector_extra_config passed to your connector as is; the API server "
        "keeps any field here without checking it.",
    )


CUSTOM_IFF_CUSTOM = "custom is required when connector is custom, and only then"


class KVTransferSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "(has(self.connector) && self.connector == 'custom') == has(self.custom)",
                CUSTOM_IFF_CUSTOM,
                ".custom",
            )
        )
    )

    connector: Connector = Field(
        Connector.MOONCAKE,
        description="Transfer backend: mooncake (Mooncake transfer engine, RDMA or TCP), pynccl (NCCL, "
        "single node multi-GPU) or custom (a connector class of your own or a vLLM built-in).",
    )
    compression: Compression = Field(
        Compression.NONE,
        description="On-the-wire KV compression: none, fp8 (e4m3) or int8, with per-block scales.",
    )
    port: Port = Field(
        DEFAULT_KV_PORT,
        description="Each engine's own KV listen port (vLLM kv_port); TP rank r's side channel uses "
        "port + r. Mooncake's RPC and data ports come from 128 ports derived from it "
        "(DLLM_KV_TRANSFER_PORTS): port+64..port+191, else the 128 below the port, else a slot in "
        "61000-65479 when those leave 1024-65535 or touch Linux's ephemeral ports 32768-60999 (as the "
        "default does). Keep the roles' HTTP ports out of these.",
    )
    buffer_size_gb: PositiveFloat = Field(
        DEFAULT_BUFFER_SIZE_GB,
        alias="bufferSizeGB",
        description="Registered staging buffer for (compressed) KV, in GB; a role's bufferSizeGB overrides "
        "it. Counted in the pod's memory request.",
    )
    transfer_threshold_tokens: PositiveInt = Field(
        DEFAULT_TRANSFER_THRESHOLD_TOKENS, description="KV is sent in batches of at least this many tokens."
    )
    timeout_ms: PositiveInt = Field(
        DEFAULT_TRANSFER_TIMEOUT_MS, description="Timeout of one transfer, first byte to done, in ms."
    )
    prefill_wait_ms: PositiveInt = Field(
        DEFAULT_PREFILL_WAIT_MS,
        description="How long decode waits for a request's KV to arrive, in ms (covers prefill queueing).",
    )
    hold_seconds: PositiveInt = Field(
        DEFAULT_HOLD_SECONDS, description="How long prefill keeps KV that no decode has claimed, in s."
    )
    async_transfer: bool = Field(
        True,
        alias="async",
        description="Prefill overlaps sending with later work; false: a prefill request finishes only once "
        "its KV is delivered. Decode always loads asynchronously.",
    )
    protocol: Literal["", "rdma", "tcp"] = Field(
        "",
        description="Mooncake transport: rdma or tcp. Empty: rdma when rdma.enabled, else tcp.",
        json_schema_extra={EMPTY_DEFAULT_IS_A_CHOICE: True},
    )
    load_failure_policy: LoadFailurePolicy = Field(
        LoadFailurePolicy.FAIL,
        description="What decode does when KV cannot be loaded: fail the request, or recompute the prompt "
        "(vLLM kv_load_failure_policy).",
    )
    custom: CustomConnectorSpec | None = Field(
        None, description="The connector class, required iff connector is custom."
    )


class RDMAMode(StrEnum):
    DEVICE_PLUGIN = "devicePlugin"
    HOST_DEVICES = "hostDevices"


HOST_DEVICES_NEED_RDMA = "mode hostDevices requires enabled: true"
HOST_NETWORK_NEEDS_RDMA = "hostNetwork requires enabled: true"


class RDMASpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=rules(
            cel(
                "!has(self.mode) || self.mode != 'hostDevices' || (has(self.enabled) && self.enabled)",
                HOST_DEVICES_NEED_RDMA,
                ".mode",
            ),
            cel(
                "!has(self.hostNetwork) || !self.hostNetwork || (has(self.enabled) && self.enabled)",
                HOST_NETWORK_NEEDS_RDMA,
                ".hostNetwork",
            ),
        )
    )

    enabled: bool = Field(False, description="Give engine pods RDMA devices and use the rdma protocol.")
    mode: RDMAMode = Field(
        RDMAMode.DEVICE_PLUGIN,
        description="devicePlugin: request resourceName from an RDMA device plugin (least privilege). "
        "hostDevices: mount /dev/infiniband from the host (adds IPC_LOCK and SYS_RESOURCE; needs a "
        "namespace that allows hostPath).",
    )
    resource_name: Name = Field(
        "rdma/hca_shared_devices_a", description="Extended resource of the RDMA device plugin."
    )
    resources_per_pod: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="How many of resourceName each engine pod requests."
    )
    devices: Annotated[tuple[Annotated[str, Field(max_length=64)], ...], Field(max_length=64)] = Field(
        (), description="NIC allow-list, e.g. mlx5_0 (MOONCAKE_RDMA_DEVICE); empty: all."
    )
    gid_index: Annotated[int, Field(ge=0, le=255)] | None = Field(
        None, description="RoCE GID index (MC_GID_INDEX); unset: Mooncake's default."
    )
    networks: Annotated[tuple[Name, ...], Field(max_length=64)] = Field(
        (),
        description="Multus NetworkAttachmentDefinition names for the RDMA network "
        "(k8s.v1.cni.cncf.io/networks).",
    )
    host_network: bool = Field(
        False,
        description="Use the host network (requires enabled); then one engine pod per node per role "
        "(anti-affinity) so ports do not clash. NetworkPolicy does not apply to host-network pods, and the "
        f"chart's admission policy refuses it outside {OPTED_IN}.",
    )
    ipc_lock: bool = Field(
        True,
        description="Add the IPC_LOCK capability (with enabled) so Mooncake can pin its registered buffer "
        "whatever the node's memlock limit. Pod Security baseline does not allow IPC_LOCK: set false where "
        "the container runtime gives containers an unlimited RLIMIT_MEMLOCK and the namespace enforces "
        "baseline.",
    )
