"""Operator configuration: defaults that come from the operator's deployment, not from a CR.

One frozen model, filled from the DLLM_* variables (strings, pydantic's lax mode) and, for the settings
`dllm-operator run` also takes as flags, from those; a bad value is a ConfigInvalid naming where it
came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from dllm_contract import logs
from dllm_contract.problems import first_problem

DEFAULT_ENGINE_IMAGE = "ghcr.io/dllm-operator/vllm:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/dllm-operator/router:0.1.0"


class ConfigInvalid(ValueError):
    """An operator setting with a bad value; the message names the variable."""


def _comma_list(raw: Any) -> Any:
    """ "a, b," as ("a", "b"): blanks and empty items dropped."""
    if not isinstance(raw, str):
        return raw
    return tuple(item.strip() for item in raw.split(",") if item.strip())


CommaList = Annotated[tuple[str, ...], BeforeValidator(_comma_list)]


def _label_pairs(raw: Any) -> Any:
    """ "a=1, b=2" as {"a": "1", "b": "2"}; an item without "=" is an error."""
    if not isinstance(raw, str):
        return raw
    pairs = _comma_list(raw)
    bad = [item for item in pairs if "=" not in item]
    if bad:
        raise ValueError(f"{bad[0]!r} is not key=value")
    return dict(item.split("=", 1) for item in pairs)


class OperatorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_image: str = DEFAULT_ENGINE_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE
    cluster_domain: str = "cluster.local"
    # Empty: every namespace (cluster mode).
    namespaces: CommaList = ()
    # The one logging scheme's default and check (dllm_contract.logs), as for dllm-serve and the router.
    log_level: Annotated[str, AfterValidator(logs.checked_level)] = logs.DEFAULT_LEVEL
    # H7: false refuses CRs asking for host network, host devices, other Secrets in env, network or
    # AppArmor annotations or tolerate-everything tolerations (render/policy.py), in every namespace.
    # The chart's admission policy does the same per namespace; this is for clusters without it.
    allow_privileged_engines: bool = True
    # Non-empty: every image a CR names must start with one of these (e.g. "registry.example.com/").
    allowed_image_prefixes: CommaList = ()
    # With allow_privileged_engines false (NEW-4): the only hub token Secrets and PVCs a CR may name
    # (whoever may create the CR reads what they hold). The chart's admission policy uses the same lists.
    hub_token_secrets: CommaList = ("hf-token",)
    model_volume_claims: CommaList = ("models", "hf-cache")
    # The hub mirror engines use (HF_ENDPOINT), an administrator's choice: a CR's env may not set it.
    hub_endpoint: str = ""
    # How often a full listing is merged into the caches: the safety net for events a watch missed
    # (there is no polling otherwise). Tests shorten it to see that a resync writes nothing.
    resync_seconds: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
    # The operator's own pod (the chart passes them by the downward API): the leader lease's holder
    # identity and, unless --lease-namespace says otherwise, the lease's namespace. Unset off-cluster.
    pod_name: str | None = None
    pod_namespace: str | None = None
    # The operator pod's labels, "k=v,k=v" (the chart passes its selector labels): with pod_namespace, the
    # router's NetworkPolicy admits the operator to read the KV check. Unset off-cluster.
    pod_labels: Annotated[dict[str, str], BeforeValidator(_label_pairs)] = Field(default_factory=dict)
    # How often the operator reads each ready router pod's KV check page (kv_poll.py); 0: never (then
    # KVTransferVerified stays Unknown). The router checks a new pair at once, so a rollout's verdict
    # shows within this.
    kv_check_poll_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 15.0
    # How long a new engine pod must have been ready before a rollout counts it as serving and lets an
    # old pod go (rollout.py): the router finds pods by DNS and health checks, every 5 s each.
    rollout_settle_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 15.0
    # How often the autoscaler reads the metrics of resources with spec.autoscaling (autoscale/); 0: never.
    autoscale_poll_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 15.0

    @field_validator("allow_privileged_engines", mode="before")
    @classmethod
    def _true_or_false(cls, raw: Any, info: ValidationInfo) -> Any:
        """Only "true" or "false" (any case); blank is the default."""
        if not isinstance(raw, str):
            return raw
        text = raw.strip().lower()
        if not text:
            return cls.model_fields[str(info.field_name)].default
        if text not in ("true", "false"):
            raise ValueError(f"{text!r} is not true or false")
        return text == "true"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **given: Any) -> OperatorConfig:
        """The settings from their variables (ENV_NAMES); `given` ones (the command line's) win.
        ConfigInvalid naming the first bad setting's flag and variable."""
        values = {field: env[name] for field, name in ENV_NAMES.items() if name in env}
        try:
            return cls.model_validate({**values, **given})
        except ValidationError as error:
            field, message = first_problem(error)
            raise ConfigInvalid(f"{_where(field)}: {message}") from None


# field -> the variable that sets it (in the chart's deployment).
ENV_NAMES: Mapping[str, str] = {
    "engine_image": "DLLM_ENGINE_IMAGE",
    "router_image": "DLLM_ROUTER_IMAGE",
    "cluster_domain": "DLLM_CLUSTER_DOMAIN",
    "namespaces": "DLLM_WATCH_NAMESPACES",
    "log_level": logs.ENV_LOG_LEVEL,
    "allow_privileged_engines": "DLLM_ALLOW_PRIVILEGED_ENGINES",
    "allowed_image_prefixes": "DLLM_ALLOWED_IMAGE_PREFIXES",
    "hub_token_secrets": "DLLM_HUB_TOKEN_SECRETS",
    "model_volume_claims": "DLLM_MODEL_VOLUME_CLAIMS",
    "hub_endpoint": "DLLM_HF_ENDPOINT",
    "resync_seconds": "DLLM_RESYNC_SECONDS",
    "pod_name": "POD_NAME",
    "pod_namespace": "POD_NAMESPACE",
    "pod_labels": "DLLM_OPERATOR_POD_LABELS",
    "kv_check_poll_seconds": "DLLM_KV_CHECK_POLL_SECONDS",
    "autoscale_poll_seconds": "DLLM_AUTOSCALE_POLL_SECONDS",
    "rollout_settle_seconds": "DLLM_ROLLOUT_SETTLE_SECONDS",
}
# field -> the `dllm-operator run` flag that also sets it.
FLAGS: Mapping[str, str] = {"log_level": logs.LOG_LEVEL_FLAG, "namespaces": "--namespace"}


def _where(field: str) -> str:
    variable = ENV_NAMES.get(field, field)
    return f"{FLAGS[field]} (or {variable})" if field in FLAGS else variable
