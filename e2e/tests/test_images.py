"""The images `make images` builds here: run as users meet them, and rebuilt only when an input changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "images"))
import inputs  # noqa: E402

IMAGES = ("operator", "router", "vllm-cpu")
PREFIX = os.environ.get("DLLM_IMAGE_PREFIX", "localhost/dllm")
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "images" / "containers.conf")}


def _inspect(ref: str) -> dict[str, object]:
    out = subprocess.run(
        ["podman", "image", "inspect", ref], check=False, capture_output=True, text=True, env=ENV
    )
    assert out.returncode == 0, f"{ref} is not built (make images): {out.stderr}"
    config: dict[str, object] = json.loads(out.stdout)[0]["Config"]
    return config


def test_dockerignore_allow_list_semantics() -> None:
    rules = inputs.parse_ignore("# comment\n*\n!connector/src/\n!requirements/deps.lock\n**/__pycache__\n")
    assert inputs.in_context("connector/src/dllm_connector/serve.py", rules)
    assert inputs.in_context("requirements/deps.lock", rules)
    assert not inputs.in_context("requirements/dev.in", rules)
    assert not inputs.in_context("connector/tests/test_x.py", rules)
    assert not inputs.in_context("connector/src/dllm_connector/__pycache__/serve.cpython-311.pyc", rules)
    assert not inputs.in_context("README.md", rules)


def test_inputs_hash_follows_base_and_image() -> None:
    base = inputs.inputs_hash("router", ["base-a"])
    assert inputs.inputs_hash("router", ["base-a"]) == base
    assert inputs.inputs_hash("router", ["base-b"]) != base
    assert inputs.inputs_hash("operator", ["base-a"]) != base


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGES)
def test_image_runs_as_a_numeric_non_root_user(name: str) -> None:
    config = _inspect(f"{PREFIX}/{name}:dev")
    user = str(config.get("User") or "")
    uid = user.split(":")[0]
    assert uid.isdigit(), f"{name} runs as {user!r}, not a numeric user"
    assert uid != "0", f"{name} runs as root"
    entrypoint = config.get("Entrypoint")
    assert entrypoint == [{"operator": "dllm-operator", "router": "dllm-router"}.get(name, "dllm-serve")]


@pytest.mark.slow
def test_a_warm_rebuild_builds_nothing() -> None:
    result = subprocess.run(
        ["bash", ROOT / "images" / "build.sh"],
        check=False,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in IMAGES:
        assert f"{PREFIX}/{name}:dev: cached" in result.stderr, result.stderr
    assert "building" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("user", ["10001", "54321:0"])  # the image's user; another uid of group 0
def test_the_engine_image_knows_the_samples_model_classes_without_a_second_vllm_process(user: str) -> None:
    """The image carries vLLM's model-class cache (dllm_connector/model_info_cache.py): an engine start
    reads it instead of importing vLLM again in a child process to inspect the class."""
    script = (
        "from vllm.model_executor.models import registry\n"
        "def no_child(fn):\n"
        "    raise AssertionError('vLLM started a process to inspect the model class')\n"
        "registry._run_in_subprocess = no_child\n"
        "for arch in ('LlamaForCausalLM', 'DeepseekV2ForCausalLM', 'DeepseekV3ForCausalLM'):\n"
        "    print(arch, registry.ModelRegistry.models[arch].inspect_model_cls().is_text_generation_model)\n"
    )
    argv = ["podman", "run", "--rm", "--network", "none", "--user", user, "--entrypoint", "python3"]
    result = subprocess.run(
        [*argv, f"{PREFIX}/vllm-cpu:dev", "-c", script],
        check=False, capture_output=True, text=True, env=ENV, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [
        "LlamaForCausalLM", "True", "DeepseekV2ForCausalLM", "True", "DeepseekV3ForCausalLM", "True"
    ]  # fmt: skip
