"""What a prefill or decode engine is told: the env contract's KV settings, the model's source and the
vLLM serve flags of its role. Pure."""

from __future__ import annotations

from typing import Any, Literal

from dllm_contract.kvconfig import (
    DOWNWARD_API_ENV,
    CustomConnector,
    KVTransferSettings,
    Protocol,
    Role,
    to_env,
)
from dllm_operator.api import DisaggregatedLLM, RoleSpec
from dllm_operator.render import auth, labels
from dllm_operator.render.ports import transfer_port_range

EngineRole = Literal["prefill", "decode"]
MODEL_MOUNT = "/models"
HF_CACHE_MOUNT = "/var/cache/huggingface"


def role_spec(cr: DisaggregatedLLM, role: EngineRole) -> RoleSpec:
    return cr.spec.prefill if role == "prefill" else cr.spec.decode


def buffer_size_gb(cr: DisaggregatedLLM, role: EngineRole) -> float:
    return role_spec(cr, role).buffer_size_gb or cr.spec.kv_transfer.buffer_size_gb


def transfer_protocol(cr: DisaggregatedLLM) -> Protocol:
    explicit = cr.spec.kv_transfer.protocol
    if explicit:
        return Protocol(explicit)
    return Protocol.RDMA if cr.spec.rdma.enabled else Protocol.TCP


def kv_settings(cr: DisaggregatedLLM, role: EngineRole) -> KVTransferSettings:
    """The env contract of one role, before the pod-only values (host IP, engine id)."""
    kv = cr.spec.kv_transfer
    custom = None
    if kv.custom is not None:
        custom = CustomConnector(
            connector_class=kv.custom.connector_class,
            module_path=kv.custom.module_path or None,
            extra_config=kv.custom.extra_config,
        )
    sends = role == "prefill"
    peer: EngineRole = "decode" if sends else "prefill"
    return KVTransferSettings(
        connector=kv.connector,
        role=Role(role),
        listen_port=kv.port,
        buffer_size_gb=buffer_size_gb(cr, role),
        compression=kv.compression,
        transfer_threshold_tokens=kv.transfer_threshold_tokens,
        transfer_timeout_ms=kv.timeout_ms,
        prefill_wait_ms=None if sends else kv.prefill_wait_ms,
        hold_seconds=kv.hold_seconds if sends else None,
        async_transfer=kv.async_transfer,
        load_failure_policy=kv.load_failure_policy,
        protocol=transfer_protocol(cr),
        decode_host=labels.child_name(cr, "decode") if sends else None,
        decode_port=kv.port if sends else None,
        transfer_ports=transfer_port_range(kv.port),
        peer_tp_size=role_spec(cr, peer).tensor_parallel_size,
        rdma_devices=cr.spec.rdma.devices if cr.spec.rdma.enabled else (),
        gid_index=cr.spec.rdma.gid_index if cr.spec.rdma.enabled else None,
        custom=custom,
    )


def engine_env(cr: DisaggregatedLLM, role: EngineRole, hub_endpoint: str = "") -> list[dict[str, Any]]:
    """`hub_endpoint`: the operator's hub mirror (HF_ENDPOINT), which a resource's env may not set."""
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in to_env(kv_settings(cr, role)).items()]
    env += [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in DOWNWARD_API_ENV.items()
    ]
    if cr.spec.security.authentication:  # by reference: the operator never reads the values
        env += [
            auth.secret_ref(cr, auth.KV_TOKEN_ENV, auth.KV_TOKEN_KEY),
            auth.secret_ref(cr, auth.ENGINE_API_KEY_ENV, auth.API_KEY_KEY),
        ]
    env += _model_source_env(cr)
    if hub_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hub_endpoint})
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in role_spec(cr, role).env]
    return env


def _model_source_env(cr: DisaggregatedLLM) -> list[dict[str, Any]]:
    source = cr.spec.model.source
    if source is None or source.hugging_face is None:
        return []
    hub = source.hugging_face
    env: list[dict[str, Any]] = []
    if hub.token_secret_ref is not None:
        ref = {"name": hub.token_secret_ref.name, "key": hub.token_secret_ref.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    if hub.cache_volume_claim:
        env.append({"name": "HF_HOME", "value": HF_CACHE_MOUNT})
    return env


def model_argument(cr: DisaggregatedLLM) -> str:
    source = cr.spec.model.source
    if source is not None and source.pvc is not None:
        return f"{MODEL_MOUNT}/{source.pvc.sub_path}".rstrip("/")
    return cr.spec.model.name


# Of the grace period, what the preStop drain may use; the rest covers vLLM's own teardown.
SHUTDOWN_MARGIN_S = 10


def drain_budget_s(spec: RoleSpec) -> int:
    """Seconds an engine gives requests in flight when it is stopped: the preStop drain's limit, and
    after SIGTERM vLLM's --shutdown-timeout (drain, not abort), so that a request that reached the
    engine after the drain's last idle reading still finishes instead of being aborted."""
    return max(spec.termination_grace_period_seconds - SHUTDOWN_MARGIN_S, 0)


def engine_args(cr: DisaggregatedLLM, role: EngineRole) -> list[str]:
    """vLLM serve flags of one role; the KV-transfer config is added by dllm-serve from the env."""
    model, spec = cr.spec.model, role_spec(cr, role)
    args = ["--model", model_argument(cr)]
    served = model.served_model_name or (model.name if model_argument(cr) != model.name else "")
    optional: list[tuple[str, object]] = [
        ("--served-model-name", served),
        ("--revision", model.revision),
        ("--max-model-len", model.max_model_len),
        ("--block-size", model.block_size),
    ]
    args += [item for flag, value in optional if value for item in (flag, str(value))]
    args += [
        flag
        for name, value in (("--dtype", model.dtype), ("--kv-cache-dtype", model.kv_cache_dtype))
        if value != "auto"
        for flag in (name, value)
    ]
    args += [
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
    ]  # fmt: skip
    if spec.enable_chunked_prefill is not None:
        args.append(
            "--enable-chunked-prefill" if spec.enable_chunked_prefill else "--no-enable-chunked-prefill"
        )
    args += ["--shutdown-timeout", str(drain_budget_s(spec))]
    args += ["--host", "0.0.0.0", "--port", str(spec.port)]
    return args + list(spec.extra_args)
