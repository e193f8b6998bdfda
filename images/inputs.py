"""The hash of everything an image is built from, so that images/build.sh rebuilds only on a change.

`python3 images/inputs.py NAME EXTRA...` prints a short hash of: the image's Dockerfile, every file of
the repository that its allow-list `Dockerfile.dockerignore` lets into the build context (path and
content), and EXTRA (the base image's id, build arguments). Files come from git: tracked ones and
untracked ones git does not ignore, as a clone would have them.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pattern(glob: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over /-separated paths (`**` crosses directories)."""
    out = []
    for part in re.split(r"(\*\*/?|\*|\?)", glob.strip("/")):
        if part.startswith("**"):
            out.append("(?:.*/)?" if part.endswith("/") else ".*")
        elif part == "*":
            out.append("[^/]*")
        elif part == "?":
            out.append("[^/]")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def parse_ignore(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(include, pattern) rules in file order; later rules win, as in Docker."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        rules.append((include, _pattern(line.lstrip("!").strip())))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether `path` enters the context: a rule naming a directory covers everything under it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    kept = True
    for include, pattern in rules:
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            kept = include
    return kept


def inputs_hash(name: str, extra: list[str]) -> str:
    dockerfile = ROOT / "images" / name / "Dockerfile"
    rules = parse_ignore((dockerfile.parent / "Dockerfile.dockerignore").read_text())
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    digest = hashlib.sha256(dockerfile.read_bytes())
    for path in sorted(p for p in listed.split("\0") if p and in_context(p, rules)):
        file = ROOT / path
        if file.is_file():
            digest.update(f"\0{path}\0".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    for item in extra:
        digest.update(f"\0{item}".encode())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    print(inputs_hash(sys.argv[1], sys.argv[2:]))
