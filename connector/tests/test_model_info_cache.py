"""The model-class cache the engine image is built with: vLLM reads what it wrote and starts no second
Python process to learn the class; an architecture it cannot cache fails the build, named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(300)]

# vLLM as an engine start uses it, with the child process it would start forbidden.
INSPECT_WITHOUT_A_CHILD = """
import sys
from vllm.model_executor.models import registry

def no_child(fn):
    raise AssertionError("vLLM started a process to inspect the model class")

registry._run_in_subprocess = no_child
info = registry.ModelRegistry.models[sys.argv[1]].inspect_model_cls()
print(type(info).__name__, info.is_text_generation_model)
"""


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    argv = [sys.executable, *args]
    return subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=240)


def test_vllm_reads_the_cache_it_is_given_without_a_second_process(tmp_path: Path) -> None:
    cold = _run(tmp_path, "-c", INSPECT_WITHOUT_A_CHILD, "LlamaForCausalLM")
    assert cold.returncode != 0  # the test sees a cold cache
    assert "started a process" in cold.stderr

    filled = _run(tmp_path, "-m", "dllm_connector.model_info_cache", "--only", "LlamaForCausalLM")
    assert filled.returncode == 0, filled.stdout + filled.stderr
    assert "model info cached for 1 architectures; 0 do not import here" in filled.stdout
    warm = _run(tmp_path, "-c", INSPECT_WITHOUT_A_CHILD, "LlamaForCausalLM")
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout.split() == ["_ModelInfo", "True"]


def test_an_architecture_that_is_not_cached_fails_naming_it(tmp_path: Path) -> None:
    result = _run(tmp_path, "-m", "dllm_connector.model_info_cache", "--only", "NoSuchModelForCausalLM")
    assert result.returncode == 1
    assert "error: not cached: NoSuchModelForCausalLM" in result.stderr
    assert not (tmp_path / "modelinfos").exists() or not any((tmp_path / "modelinfos").iterdir())
