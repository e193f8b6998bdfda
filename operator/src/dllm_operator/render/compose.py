"""docker-compose for one host, mirroring the same topology (the seed started there). Pure text."""

from __future__ import annotations

from importlib import resources
from typing import Any

import jinja2

from dllm_contract.kvconfig import ENV_DECODE_IP, ENV_ENGINE_ID, ENV_HOST_IP, to_env
from dllm_operator.api import DisaggregatedLLM, RDMAMode
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth
from dllm_operator.render.engine_command import EngineRole, engine_args, kv_settings, role_spec
from dllm_operator.render.engine_container import GPU_RESOURCE, engine_resources
from dllm_operator.render.router import router_command_args

# The compose file holds no secret: with authentication on, the engines take DLLM_KV_AUTH_TOKEN and
# VLLM_API_KEY from the environment of the compose run (unset there: none), and the router gets the
# same VLLM_API_KEY. A null value is compose's "pass this variable through".
COMPOSE_API_KEY = "${VLLM_API_KEY:-}"

# The seed's service names and host ports: both engines share one host, so decode moves to 8001.
SERVICE = {"prefill": "prefill-server", "decode": "decode-server"}
HOST_PORT = {"prefill": 8000, "decode": 8001}


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
        env |= {auth.KV_TOKEN_ENV: None, auth.ENGINE_API_KEY_ENV: None}
    env |= {var.name: var.value for var in spec.env if var.value is not None}
    gpus = gpu_count(cr, role)
    return {
        "service": SERVICE[role],
        "image": spec.image or cr.spec.image or config.engine_image,
        "entrypoint": ["dllm-serve"],
        "command": ["--", *engine_args(cr, role)],
        "env": env,
        "gpus": [str(i) for i in range(first_gpu, first_gpu + gpus)],
        "rdma": cr.spec.rdma.enabled,
        "shm": str(spec.shm_size_limit).replace("Gi", "g").replace("Mi", "m"),
        "port": spec.port,
        "host_port": HOST_PORT[role] if spec.port == 8000 else spec.port,
        "port_variable": f"DLLM_{role.upper()}_HOST_PORT",
    }


def gpu_count(cr: DisaggregatedLLM, role: EngineRole) -> int:
    """The GPUs the role's pods would request: its tensor-parallel size, or the user's count (0: CPU)."""
    return int(engine_resources(cr, role)["limits"].get(GPU_RESOURCE, 0))


def _router_service(cr: DisaggregatedLLM, config: OperatorConfig) -> dict[str, Any] | None:
    if not cr.spec.router.enabled:
        return None
    spec = cr.spec
    port = spec.router.port if spec.router.port not in HOST_PORT.values() else 9000
    endpoints = ["--prefill-url", f"http://{SERVICE['prefill']}:{spec.prefill.port}",
                 "--decode-url", f"http://{SERVICE['decode']}:{spec.decode.port}"]  # fmt: skip
    return {
        "image": spec.router.image or config.router_image,
        "entrypoint": ["dllm-router"],
        "command": router_command_args(cr, port, endpoints),
        "port": port,
        "depends": list(SERVICE.values()),
        "env": {auth.ROUTER_API_KEY_ENV: COMPOSE_API_KEY} if spec.security.authentication else {},
        "grace": spec.router.termination_grace_period_seconds,
    }


def render_compose(cr: DisaggregatedLLM, config: OperatorConfig | None = None) -> str:
    config = config or OperatorConfig()
    prefill_gpus = gpu_count(cr, "prefill")
    engines = [_engine_service(cr, "prefill", 0, config), _engine_service(cr, "decode", prefill_gpus, config)]
    template_text = resources.files("dllm_operator").joinpath("templates/compose.yaml.j2").read_text()
    # YAML, not HTML: every value goes through tojson, so HTML autoescaping does not apply.
    environment = jinja2.Environment(
        autoescape=False,  # noqa: S701
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    template = environment.from_string(template_text)
    return template.render(
        name=cr.name,
        engines=engines,
        router=_router_service(cr, config),
        host_devices=cr.spec.rdma.mode is RDMAMode.HOST_DEVICES,
    )
