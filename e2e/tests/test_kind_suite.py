"""The kind suite where Docker cannot run (as on these machines): it says so, exits 0 and leaves
nothing behind, instead of failing half-way through a cluster it cannot create."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_docker_engine_the_kind_suite_says_so_and_does_nothing(tmp_path: Path) -> None:
    """fake_docker_without_engine: a `docker` client whose `info` fails, as one with no daemon does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text('#!/bin/sh\necho "Cannot connect to the Docker daemon" >&2\nexit 1\n')
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", DLLM_CP_CACHE=str(cache))
    script = str(ROOT / "e2e" / "kind" / "run.sh")
    result = subprocess.run(
        ["bash", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "skipped: no Docker engine"
    assert not cache.exists()  # no kind built, no cluster made
