"""Start the CPU PD pipeline on 127.0.0.1 from what the operator renders for crds/samples/cpu-tiny.yaml.

Each engine runs `dllm-serve -- <args>` with the env and args of its rendered StatefulSet (the same code
path as in a pod), changed only by these local overrides (everything else is as rendered):
- addresses: VLLM_HOST_IP=127.0.0.1, VLLM_KV_DECODE_IP=127.0.0.1, `--host 127.0.0.1` (pods have their own IP)
- ports: `--port`, VLLM_KV_LISTEN_PORT and VLLM_KV_DECODE_PORT get free ports (both engines share one host)
- DLLM_ENGINE_ID: prefill-0 / decode-0 (the pod name in a cluster)
- `--model`: the tiny Llama made at test time (e2e/dataplane/tiny_model.py) instead of /models/tiny-llama
- VLLM_CPU_OMP_THREADS_BIND: one core per engine; VLLM_CPU_KVCACHE_SPACE=1 (GiB, already in the sample)
- VLLM_KV_COMPRESSION: set per test (none, fp8, int8)
- the per-resource auth Secret: made here (random keys, as the operator makes them) and given to the
  env names the rendered containers take from it, so authentication is on as the chart deploys it:
  the side channel's HMAC key on both engines, the engine API key on the engines and the router
`--block-size 32` and the 0.25 GB buffer come from the sample itself.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from dllm_operator.api import DisaggregatedLLM, parse
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth
from dllm_operator.render.engine import statefulset
from dllm_operator.render.engine_command import EngineRole
from dllm_operator.render.router import router_deployment
from e2e.dataplane import tiny_corpus
from e2e.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "crds" / "samples" / "cpu-tiny.yaml"
_PAUSE = threading.Event()


def sample(compression: str = "none") -> DisaggregatedLLM:
    body = next(
        d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "DisaggregatedLLM"
    )
    body["spec"]["kvTransfer"]["compression"] = compression
    return parse(body)


def new_auth_secret() -> dict[str, str]:
    """The auth Secret's keys and values, random as the operator makes them (render/auth.py)."""
    return {auth.KV_TOKEN_KEY: secrets.token_hex(32), auth.API_KEY_KEY: secrets.token_hex(32)}


def container_env(
    cr: DisaggregatedLLM, container: dict[str, Any], secret: Mapping[str, str] | None
) -> dict[str, str]:
    """A rendered container's plain values and, with `secret`, what it takes from the resource's auth
    Secret (without: no authentication)."""
    env = {var["name"]: var["value"] for var in container.get("env", []) if "value" in var}
    if secret is None:
        return env
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None and ref["name"] == auth.secret_name(cr):
            env[var["name"]] = secret[ref["key"]]
    return env


def rendered_engine(
    role: EngineRole, compression: str = "none", secret: Mapping[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """The env and vLLM args of a role, exactly as the operator renders them; without `secret`, the
    plain values only (no authentication)."""
    cr = sample(compression)
    container = statefulset(cr, role, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]
    env = container_env(cr, container, secret)
    args = list(container["args"])
    assert args[0] == "--", "the engine container runs dllm-serve -- <vLLM args>"
    return env, args[1:]


def replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


@dataclass
class Process:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    port: int
    sockets: Path  # VLLM_RPC_BASE_PATH: vLLM leaves its Unix sockets behind, so they go with the process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.alive():
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if self.process.poll() is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)


def scratch_env(directory: Path) -> dict[str, str]:
    """Environment sending what vLLM leaves behind on exit to `directory`, which the caller removes with
    the process: its processes' Unix sockets (VLLM_RPC_BASE_PATH, default /tmp) and its FileStore
    rendezvous files (vllm_dist_*, in TMPDIR)."""
    return {"VLLM_RPC_BASE_PATH": str(directory), "TMPDIR": str(directory)}


def spawn(name: str, argv: list[str], env: dict[str, str], log: Path, port: int) -> Process:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MOONCAKE_", "MC_", "DLLM_"))}
    base |= {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }  # nothing leaves the host
    sockets = Path(tempfile.mkdtemp(prefix="dllm-rpc-"))
    base |= scratch_env(sockets)
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv, env={**base, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )
    return Process(name, process, log, port, sockets)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


def wait_healthy(process: Process, timeout: float = 240) -> Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise AssertionError(f"{process.name} exited ({process.process.returncode}):\n{process.tail()}")
        if http_status(process.url + "/health") == 200:
            return process
        _PAUSE.wait(0.5)
    raise AssertionError(f"{process.name} not healthy after {timeout:.0f}s:\n{process.tail()}")


@dataclass
class Pipeline:
    """Two engines and a router; engines can be restarted with the same ports."""

    model: Path
    logs: Path
    compression: str = "none"
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)
    secret: dict[str, str] = field(default_factory=new_auth_secret)
    router_extra: tuple[str, ...] = ()  # more router flags (the KV check's, say)
    engine_extra: tuple[str, ...] = ()  # more vLLM flags for both engines (tracing's, say)
    engine_env: Mapping[str, str] = field(default_factory=dict)  # more environment for both engines

    @property
    def engine_key(self) -> dict[str, str]:
        """The header the router sends the engines: the engine API key, as a Bearer token."""
        return {"Authorization": f"Bearer {self.secret[auth.API_KEY_KEY]}"}

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "prefill-kv", "decode-kv", "router"):
            self.ports.setdefault(name, free_port())

    def engine_config(self, role: EngineRole) -> tuple[dict[str, str], list[str]]:
        env, args = rendered_engine(role, self.compression, self.secret)
        env |= {
            "VLLM_HOST_IP": "127.0.0.1",
            "DLLM_ENGINE_ID": f"{role}-0",
            "VLLM_KV_LISTEN_PORT": str(self.ports[f"{role}-kv"]),
            "VLLM_CPU_OMP_THREADS_BIND": "0" if role == "prefill" else "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        if role == "prefill":
            env |= {"VLLM_KV_DECODE_IP": "127.0.0.1", "VLLM_KV_DECODE_PORT": str(self.ports["decode-kv"])}
        args = replace_flag(args, "--model", str(self.model))
        args = replace_flag(replace_flag(args, "--host", "127.0.0.1"), "--port", str(self.ports[role]))
        return env | dict(self.engine_env), [*args, *self.engine_extra]

    def start_engine(self, role: EngineRole, changes: Mapping[str, str] | None = None) -> Process:
        """Start a role as rendered, with `changes` to its vLLM flags (flag -> value) if given."""
        env, args = self.engine_config(role)
        for flag, value in (changes or {}).items():
            args = replace_flag(args, flag, value)
        argv = [sys.executable, "-m", "dllm_connector.serve", "--", *args]
        self._retire(role)
        process = spawn(role, argv, env, self.logs / f"{role}.log", self.ports[role])
        self.processes[role] = process
        return process

    def start_router(self, name: str = "router", extra: tuple[str, ...] = ()) -> Process:
        """The router as `name` (another name: a second router, on a port of its own), with the
        pipeline's router flags and `extra`."""
        port = self.ports.setdefault(name, free_port())
        argv = [sys.executable, "-m", "dllm_router", "--host", "127.0.0.1",
                "--port", str(port), "--flow", "dllm",
                "--prefill-url", f"http://127.0.0.1:{self.ports['prefill']}",
                "--decode-url", f"http://127.0.0.1:{self.ports['decode']}",
                "--decode-kv-port", str(self.ports["decode-kv"]),
                "--health-interval-s", "0.5", "--connect-timeout-s", "2"]  # fmt: skip
        argv += [*self.router_extra, *extra]
        cr = sample(self.compression)
        container = router_deployment(cr, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]
        env = container_env(cr, container, self.secret)
        assert set(env) >= {auth.ROUTER_API_KEY_ENV}, "the router takes the engine key from the Secret"
        self._retire(name)
        process = spawn(name, argv, env, self.logs / f"{name}.log", port)
        self.processes[name] = process
        return process

    def _retire(self, name: str) -> None:
        """Stop the process `name` names before another takes its place: one a test already ended
        still has its scratch directory to remove."""
        if (before := self.processes.pop(name, None)) is not None:
            before.stop()

    def start(self) -> Pipeline:
        engines = [self.start_engine("prefill"), self.start_engine("decode")]
        for process in engines:
            wait_healthy(process)
        wait_healthy(self.start_router(), 30)
        return self

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            process.stop()


def start_single_engine(model: Path, logs: Path, extra: tuple[str, ...] = ()) -> Process:
    """The reference: one plain vLLM engine, no KV transfer, the decode role's engine args (and
    `extra` vLLM flags, as a pipeline's engine_extra), its model run in its engine core as the
    sample's engines run theirs."""
    _, args = rendered_engine("decode")
    port = free_port()
    args = replace_flag(replace_flag(args, "--model", str(model)), "--host", "127.0.0.1")
    args = replace_flag(args, "--port", str(port))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args, *extra]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    return wait_healthy(spawn("single", argv, env, logs / "single.log", port))


def post_json(
    url: str, body: dict[str, Any], timeout: float = 120, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(  # noqa: S310 (http on 127.0.0.1)
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return int(response.status), dict(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        return int(error.code), dict(json.loads(error.read() or b"{}"))


# The one chat request every way of running the CPU sample answers: make demo, the compose file, the node.
# The tiny model learnt its answer (tiny_corpus.py); it ends at the line's end.
DEMO_QUESTION, DEMO_ANSWER = tiny_corpus.CHATS[0]
DEMO_CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": DEMO_QUESTION}],
    "max_tokens": 128,
    "stop": ["\n"],
    "temperature": 0,
}


class MetricAbsent(AssertionError):
    """A metric a test reads is not on the /metrics it read: a failure, never a 0."""


def counter(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (`name` or `name`_total) whose labels include `labels`, in a
    /metrics text; MetricAbsent when no sample matches (a renamed or missing metric must not read 0)."""
    found = [
        point.value
        for family in text_string_to_metric_families(text)
        for point in family.samples
        if point.name in (name, f"{name}_total") and labels.items() <= point.labels.items()
    ]
    if not found:
        raise MetricAbsent(f"no sample of {name}{labels or ''} on this /metrics")
    return float(sum(found))


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:  # noqa: S310
        return str(response.read().decode())
