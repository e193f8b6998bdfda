"""Imports every module of a package, less the subpackages named to skip; prints how many it imported.

`python tools/import_all.py PACKAGE [SKIP,SKIP...]`, or fed on stdin to a Python inside an image
(`python - PACKAGE SKIP < tools/import_all.py`): the check that a distribution declares what it
imports, run where only its declared dependencies are installed. The word `engine` in SKIP stands for
the connector's modules that run only inside a vLLM engine (they import torch, vLLM or Mooncake).
"""

import importlib
import pkgutil
import sys

ENGINE_ONLY = (
    "dllm_connector.codec",
    "dllm_connector.end_route",
    "dllm_connector.layout",
    "dllm_connector.worker",
    "dllm_connector.pipe",
    "dllm_connector.transport",
    "dllm_connector.connector",
)


def import_all(package_name: str, skip: tuple[str, ...]) -> int:
    package = importlib.import_module(package_name)
    names = [package.__name__]
    names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    imported = 0
    for name in names:
        if not name.startswith(skip):
            importlib.import_module(name)
            imported += 1
    return imported


def parse_skip(text: str) -> tuple[str, ...]:
    words = [word for word in text.split(",") if word]
    return tuple(m for word in words for m in (ENGINE_ONLY if word == "engine" else (word,)))


if __name__ == "__main__":
    skipped = parse_skip(sys.argv[2] if len(sys.argv) > 2 else "")
    print(f"{sys.argv[1]}: imported {import_all(sys.argv[1], skipped)} modules")
