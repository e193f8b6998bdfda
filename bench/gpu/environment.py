"""What the check needs before it imports the project: torch, the project's sources, and pure
dependencies from carried wheels where the machine lacks them."""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = {"pydantic": "requirements/dev.in", "xxhash": "requirements/engine.in"}


def _pinned(name: str) -> str:
    for line in (ROOT / PINS[name]).read_text().splitlines():
        if line.strip().lower().startswith(f"{name}=="):
            return line.strip()
    return name


def prepare_imports(wheels: str | None) -> str | None:
    """Put the project on sys.path, with the wheels of `wheels` (every one, without their
    dependencies: carry each needed, one version each) installed ahead of the machine's packages;
    the reason it cannot run, else None."""
    sys.path[:0] = [str(ROOT / "contract" / "src"), str(ROOT / "connector" / "src")]
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if wheels:
        target = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
        atexit.register(shutil.rmtree, target, ignore_errors=True)
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--no-cache-dir", "--target", str(target), *map(str, sorted(Path(wheels).glob("*.whl")))]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
        if done.returncode != 0:
            return f"pip could not install the wheels of {wheels}: {done.stderr.strip()[-500:]}"
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    missing = [name for name in PINS if importlib.util.find_spec(name) is None]
    if missing:
        pins = " ".join(_pinned(name) for name in missing)
        return f"missing {', '.join(missing)}: carry wheels of {pins} for this Python and pass --wheels DIR"
    return None
