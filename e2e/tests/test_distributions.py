"""Each Python distribution declares everything it imports.

A wheel is built from each distribution and installed, alone with the dependencies it declares
(pinned by requirements/deps.lock), into an empty venv; every module that does not need an engine's
runtime is then imported there (tools/import_all.py), and the entry points answer --help. The engine's
modules need vLLM, which the serving image provides: the vllm-cpu image's own check imports them
(images/check.sh).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMPORT_ALL = ROOT / "tools" / "import_all.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    sources = tmp_path_factory.mktemp("sources")
    for dist in ("contract", "operator", "connector", "router"):
        # From a copy of what the images copy: a build/ left in the clone by an older layout would
        # otherwise put modules that no longer exist into the wheel.
        shutil.copytree(
            ROOT / dist / "src", sources / dist / "src", ignore=shutil.ignore_patterns("*.egg-info")
        )
        shutil.copy(ROOT / dist / "pyproject.toml", sources / dist)
        build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        subprocess.run([*build, "-w", out, sources / dist], check=True)
    return out


def _install_alone(where: Path, wheels: Path, requirement: str) -> Path:
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    pip: list[str | Path] = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pins = ROOT / "requirements" / "deps.lock"
    subprocess.run([*pip, "--find-links", wheels, "-c", pins, requirement], check=True)
    return python


def _imports(python: Path, package: str, skip: str = "") -> None:
    result = subprocess.run([python, IMPORT_ALL, package, skip], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{package} in a venv of its own: {result.stderr[-2000:]}"
    assert "imported" in result.stdout


def _answers_help(where: Path, script: str) -> None:
    result = subprocess.run([where / "bin" / script, "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{script} --help: {result.stderr[-2000:]}"
    assert "usage" in result.stdout.lower()


def test_operator_wheel_imports_alone(tmp_path: Path, wheels: Path) -> None:
    python = _install_alone(tmp_path / "venv", wheels, "dllm-operator")
    _imports(python, "dllm_operator")
    _imports(python, "dllm_contract")
    _answers_help(tmp_path / "venv", "dllm-operator")
    # The operator needs only the contract: the data plane is not installed beside it.
    found = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('dllm_connector') is None)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "True"


def test_router_wheel_imports_alone(tmp_path: Path, wheels: Path) -> None:
    python = _install_alone(tmp_path / "venv", wheels, "dllm-router")
    _imports(python, "dllm_router")
    _imports(python, "dllm_contract")
    _answers_help(tmp_path / "venv", "dllm-router")


@pytest.fixture(scope="module")
def connector_alone(tmp_path_factory: pytest.TempPathFactory, wheels: Path) -> Path:
    where = tmp_path_factory.mktemp("connector") / "venv"
    _install_alone(where, wheels, "dllm-connector")
    return where


def test_connector_wheel_without_extras_serves_the_env_contract(connector_alone: Path) -> None:
    _imports(connector_alone / "bin" / "python", "dllm_connector", "engine")
    _imports(connector_alone / "bin" / "python", "dllm_contract")
    _answers_help(connector_alone, "dllm-serve")


def test_the_check_sees_a_dependency_that_is_not_installed(tmp_path: Path, wheels: Path) -> None:
    """The router without its declared dependencies (aiohttp, httptools): the import check fails, loudly."""
    python = _install_alone(tmp_path / "venv", wheels, "dllm-contract")
    install: list[str | Path] = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
    ]
    subprocess.run([*install, "--find-links", wheels, "dllm-router"], check=True)
    result = subprocess.run([python, IMPORT_ALL, "dllm_router"], check=False, capture_output=True, text=True)
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr
