"""The seed's own shape: `render --format compose` of the CPU sample, run by podman-compose on the images
built here, answers the CPU sample's chat request, with decode loading the prompt's KV over the wire,
authentication on (the keys exported to the compose run, as the file's header says); without them
podman-compose refuses to start, naming them.

The test adds a compose override file, as a user would: the local images' names, the tiny model (made
here) mounted read-only at /models, and host ports drawn free (the file publishes on 127.0.0.1 only).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.dataplane import kv_moved
from e2e.dataplane.pipeline import DEMO_ANSWER, DEMO_CHAT, http_status, post_json
from e2e.dataplane.tiny_model import build
from e2e.fixtures import WaitTimeout, wait_until
from e2e.ports import free_port

pytestmark = [pytest.mark.dataplane, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = os.environ.get("DLLM_IMAGE_PREFIX", "localhost/dllm")
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "images" / "containers.conf")}


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True, env=ENV).stdout


class Compose:
    def __init__(self, workdir: Path, project: str, ports: dict[str, int]) -> None:
        self.workdir, self.project, self.ports = workdir, project, ports
        self.env = {**ENV, **{f"DLLM_{role.upper()}_HOST_PORT": str(p) for role, p in ports.items()}}
        self.env |= {"DLLM_KV_AUTH_TOKEN": secrets.token_hex(32), "VLLM_API_KEY": secrets.token_hex(32)}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        files = ["-f", "compose.yaml", "-f", "override.yaml"]
        argv = ["podman-compose", "-p", self.project, *files, *args]
        return subprocess.run(
            argv, cwd=self.workdir, env=self.env, capture_output=True, text=True, check=False
        )

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def container(self, role: str) -> str:
        return f"{self.project}_{role}-server_1"

    def state(self, role: str) -> str:
        return podman("inspect", "--format", "{{.State.Status}}", self.container(role)).strip()

    def logs(self, role: str) -> str:
        logs = subprocess.run(
            ["podman", "logs", "--tail", "60", self.container(role)],
            capture_output=True, text=True, check=False, env=ENV,
        )  # fmt: skip
        return f"{self.container(role)} ({self.state(role)}):\n{logs.stdout}{logs.stderr}"

    def wait_healthy(self, role: str, timeout: float) -> None:
        """Until the engine answers /health; fails at once if its container stopped, with its log."""

        def healthy() -> bool:
            if self.state(role) != "running":  # podman-compose up -d ignores a start that failed
                raise AssertionError(f"the {role} engine is not running:\n{self.logs(role)}")
            return http_status(f"{self.url(role)}/health") == 200

        try:
            wait_until(healthy, timeout, f"{role} engine /health", interval=1.0)
        except WaitTimeout as timeout_error:
            raise AssertionError(f"{timeout_error}\n{self.logs(role)}") from timeout_error

    def leftovers(self) -> list[str]:
        label = f"label=io.podman.compose.project={self.project}"
        containers = podman("ps", "-a", "--filter", label, "--format", "{{.Names}}").split()
        networks = podman("network", "ls", "--filter", label, "--format", "{{.Name}}").split()
        return containers + networks


def rendered_sample() -> str:
    render = [sys.executable, "-m", "dllm_operator", "render", "--format", "compose"]
    sample = ["-f", "crds/samples/cpu-tiny.yaml"]
    return subprocess.run([*render, *sample], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def test_without_the_keys_compose_refuses_to_start_naming_them(tmp_path: Path) -> None:
    """NEW-10: authentication on in the resource never turns silently off in compose."""
    (tmp_path / "compose.yaml").write_text(rendered_sample())
    env = {k: v for k, v in ENV.items() if k not in ("DLLM_KV_AUTH_TOKEN", "VLLM_API_KEY")}
    project = f"dllmnokeys{os.getpid()}"
    result = subprocess.run(
        ["podman-compose", "-p", project, "-f", "compose.yaml", "up", "-d"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout
    assert "is unset: export it" in result.stdout + result.stderr
    label = f"label=io.podman.compose.project={project}"
    assert podman("ps", "-a", "--filter", label, "--format", "{{.Names}}").split() == []


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    for image in ("vllm-cpu", "router"):
        exists = subprocess.run(["podman", "image", "exists", f"{PREFIX}/{image}:dev"], check=False, env=ENV)
        assert exists.returncode == 0, f"{PREFIX}/{image}:dev is not built: run `make images`"
    # A directory the engines' user (10001) can read, as a model volume would be.
    workdir = Path(tempfile.mkdtemp(prefix="dllm-compose-"))
    workdir.chmod(0o755)
    model = build(workdir / "models" / "tiny-llama")
    for path in (workdir / "models", model, *model.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    (workdir / "compose.yaml").write_text(rendered_sample())
    engine = {"image": f"{PREFIX}/vllm-cpu:dev", "volumes": [f"{workdir / 'models'}:/models:ro"]}
    override = {"services": {"prefill-server": engine, "decode-server": engine,
                             "router": {"image": f"{PREFIX}/router:dev"}}}  # fmt: skip
    (workdir / "override.yaml").write_text(yaml.safe_dump(override))
    ports = {role: free_port() for role in ("prefill", "decode", "router")}
    stack = Compose(workdir, f"dllmtest{os.getpid()}", ports)
    try:
        started = stack.run("up", "-d")
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        for role in ("prefill", "decode"):
            stack.wait_healthy(role, 300)
        # /ready is 503 until the router's own checks have seen both engines ready.
        wait_until(lambda: http_status(stack.url("router") + "/ready") == 200, 60, "the router's /ready")
        yield stack
    finally:
        stack.run("down")
        for network in podman("network", "ls", "--format", "{{.Name}}").split():
            if network.startswith(stack.project):
                podman("network", "rm", "-f", network)
        shutil.rmtree(workdir, ignore_errors=True)
    assert stack.leftovers() == []


def test_the_rendered_compose_file_answers_a_chat_completion(compose: Compose) -> None:
    decode = compose.url("decode")
    before = kv_moved.at(decode, compose.url("router"), one_decode=True)  # a published port
    status, body = post_json(compose.url("router") + "/v1/chat/completions", DEMO_CHAT)
    assert status == 200, json.dumps(body)[:2000]
    # The tiny model's learnt answer, in words, to the end of its line.
    assert body["choices"][0]["message"]["content"].startswith(DEMO_ANSWER[:20]), body
    assert body["choices"][0]["finish_reason"] == "stop", body
    # Decode computed none of the prompt: every token came from prefill, over Mooncake, in the bytes
    # the layout gives for its blocks.
    model = compose.workdir / "models" / "tiny-llama"
    want = kv_moved.for_sample(model, [int(body["usage"]["prompt_tokens"])])
    kv_moved.wait_for(decode, before, want, router_url=compose.url("router"), one_decode=True)
