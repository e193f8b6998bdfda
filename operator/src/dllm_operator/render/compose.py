"""docker-compose for one host, mirroring the same topology (the seed started there). Pure: a document
built as data and dumped by PyYAML."""

from __future__ import annotations

from typing import Any

import yaml

from dllm_contract.kvconfig import ENV_DECODE_IP, ENV_ENGINE_ID, ENV_HOST_IP, to_env
from dllm_contract.router_defaults import DEFAULT_HTTP_PORT
from dllm_operator.api import DisaggregatedLLM
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth
from dllm_operator.render.engine_command import EngineRole, engine_args, kv_settings, role_spec
from dllm_operator.render.engine_container import GPU_RESOURCE, engine_resources
from dllm_operator.render.router import router_command_args

# The compose file holds no secret: with authentication on, the engines take DLLM_KV_AUTH_TOKEN and
# VLLM_API_KEY from the environment of the compose run, and the router gets the same VLLM_API_KEY. Both
# are required there (compose's ${VAR:?message} refuses to start without them, NEW-10): authentication
# that is on in the resource never turns silently off; render with it off to run without.
_UNSET = "is unset: export it (e.g. $(openssl rand -hex 32)), or render with security.authentication false"


def _required(name: str) -> str:
    return "${" + name + ":?" + name + " " + _UNSET + "}"


COMPOSE_API_KEY = _required(auth.ENGINE_API_KEY_ENV)

# The seed's service names and host ports: both engines share one host, so decode moves to 8001.
SERVICE = {"prefill": "prefill-server", "decode": "decode-server"}
HOST_PORT = {"prefill": 8000, "decode": 8001}
NETWORK = "pd-network"
HEADER = """\
# docker-compose for one host, rendered by `python -m dllm_operator render --format compose` from
# DisaggregatedLLM {name}: the same engines, env contract and router as on Kubernetes.
# Each role gets as many GPUs as its tensor-parallel size, by index; KV moves over Mooncake in the engines.
# Ports are published on 127.0.0.1 only; the host side of each can be moved with the variable named in
# it, e.g. DLLM_ROUTER_HOST_PORT=9100 podman-compose up. No secret is written here: with
# spec.security.authentication, the engines take DLLM_KV_AUTH_TOKEN (the KV side channel's key) and
# VLLM_API_KEY (vLLM's key on /v1) from the environment of the compose run, and the router sends that
# VLLM_API_KEY; compose refuses to start without them. E.g.
#   export DLLM_KV_AUTH_TOKEN=$(openssl rand -hex 32) VLLM_API_KEY=$(openssl rand -hex 32); podman-compose up
"""


def _engine_service(
    cr: DisaggregatedLLM, role: EngineRole, first_gpu: int, config: OperatorConfig
) -> dict[str, Any]:
    spec = role_spec(cr, role)
    env: dict[str, str | None] = dict(to_env(kv_settings(cr, role)))
    if ENV_DECODE_IP in env:
        env[ENV_DECODE_IP] = SERVICE["decode"]
    env[ENV_HOST_IP] = SERVICE[role]
    env[ENV_ENGINE_ID] = SERVICE[role]
    if cr.spec.security.authentication:
        env |= {auth.KV_TOKEN_ENV: _required(auth.KV_TOKEN_ENV), auth.ENGINE_API_KEY_ENV: COMPOSE_API_KEY}
    env |= {var.name: var.value for var in spec.env if var.value is not None}
    service: dict[str, Any] = {
        "image": spec.image or cr.spec.image or config.engine_image,
        "entrypoint": ["dllm-serve"],
        "command": ["--", *engine_args(cr, role)],
        "environment": env,
    }
    gpus = gpu_count(cr, role)
    if gpus:
        device_ids = [str(i) for i in range(first_gpu, first_gpu + gpus)]
        device = {"driver": "nvidia", "device_ids": device_ids, "capabilities": ["gpu"]}
        service["deploy"] = {"resources": {"reservations": {"devices": [device]}}}
    if cr.spec.rdma.enabled:
        service |= {
            "devices": ["/dev/infiniband:/dev/infiniband"],
            "cap_add": ["IPC_LOCK"],
            "ulimits": {"memlock": -1},
        }
    host_port = HOST_PORT[role] if spec.port == DEFAULT_HTTP_PORT else spec.port
    return service | {
        "shm_size": str(spec.shm_size_limit).replace("Gi", "g").replace("Mi", "m"),
        "ports": [_published(f"DLLM_{role.upper()}_HOST_PORT", host_port, spec.port)],
        "networks": [NETWORK],
    }


def _published(variable: str, host_port: int, port: int) -> str:
    """A port published on 127.0.0.1, its host side movable with `variable` (e.g. DLLM_ROUTER_HOST_PORT=9100
    podman-compose up)."""
    return f"127.0.0.1:${{{variable}:-{host_port}}}:{port}"


def gpu_count(cr: DisaggregatedLLM, role: EngineRole) -> int:
    """The GPUs the role's pods would request: its tensor-parallel size, or the user's count (0: CPU)."""
    return int(engine_resources(cr, role)["limits"].get(GPU_RESOURCE, 0))


def _router_service(cr: DisaggregatedLLM, config: OperatorConfig) -> dict[str, Any]:
    spec = cr.spec
    port = spec.router.port if spec.router.port not in HOST_PORT.values() else 9000
    endpoints = ["--prefill-url", f"http://{SERVICE['prefill']}:{spec.prefill.port}",
                 "--decode-url", f"http://{SERVICE['decode']}:{spec.decode.port}"]  # fmt: skip
    service: dict[str, Any] = {
        "image": spec.router.image or config.router_image,
        "entrypoint": ["dllm-router"],
        "command": router_command_args(cr, port, endpoints),
    }
    if spec.security.authentication:
        service["environment"] = {auth.ROUTER_API_KEY_ENV: COMPOSE_API_KEY}
    return service | {
        "stop_grace_period": f"{spec.router.termination_grace_period_seconds}s",
        "ports": [_published("DLLM_ROUTER_HOST_PORT", port, port)],
        "depends_on": list(SERVICE.values()),
        "networks": [NETWORK],
    }


def render_compose(cr: DisaggregatedLLM, config: OperatorConfig | None = None) -> str:
    """The compose file: a comment saying what it is, then the document, dumped by PyYAML (every name
    and value quoted as YAML needs, whatever a CR holds)."""
    config = config or OperatorConfig()
    prefill_gpus = gpu_count(cr, "prefill")
    services = {
        SERVICE["prefill"]: _engine_service(cr, "prefill", 0, config),
        SERVICE["decode"]: _engine_service(cr, "decode", prefill_gpus, config),
    }
    if cr.spec.router.enabled:
        services["router"] = _router_service(cr, config)
    document = {"services": services, "networks": {NETWORK: {"driver": "bridge"}}}
    body = yaml.dump(
        document, Dumper=_ComposeDumper, sort_keys=False, default_flow_style=False, width=1 << 16
    )
    return HEADER.format(name=cr.name) + body


class _ComposeDumper(yaml.SafeDumper):
    """Lists of scalars on one line (a command reads as one), every mapping as a block."""


def _list(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.Node:
    flow = all(not isinstance(item, list | dict) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


_ComposeDumper.add_representer(list, _list)
