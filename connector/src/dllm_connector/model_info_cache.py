"""Fill vLLM's cache of what each model class supports, at image build.

At start, vLLM learns what the model's class supports (multimodal, pooling, hybrid state, ...) from a
file under VLLM_CACHE_ROOT/modelinfos made from the class's module source; without one it imports
the class in a fresh Python process (so that a GPU is not touched in the engine's own), which imports
vLLM a second time before the engine loads anything. Every new container starts without the file, so
every engine pod paid that import on every start. Run in the image build, this writes the file for
every class vLLM registers that imports here, with vLLM's own code (its hash, its format); a class
that does not import (an optional dependency missing) is left to vLLM at start, as before.

vLLM's registry is private API: the pinned vLLM is what this is written against, and the build fails
if the names it uses are gone or if the architectures the samples serve are not cached.

    python -m dllm_connector.model_info_cache [--only ARCH ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from typing import Any

# Architectures the samples and tests serve: a build that cannot cache these fails.
REQUIRED = ("LlamaForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _lazy_classes(registry: Any, only: Iterable[str]) -> dict[tuple[str, str], list[str]]:
    """(module, class) -> the architectures registered to it (aliases share a class), for those vLLM
    has not imported yet."""
    wanted = set(only)
    classes: dict[tuple[str, str], list[str]] = {}
    for arch, model in registry.ModelRegistry.models.items():
        if (not wanted or arch in wanted) and isinstance(model, registry._LazyRegisteredModel):
            classes.setdefault((model.module_name, model.class_name), []).append(arch)
    return classes


def fill(only: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """Write the cache file of every registered class (or those of `only`). Returns the architectures
    whose class is cached and, for each whose class is not, why."""
    from vllm.model_executor.models import registry

    # The class is imported here instead of in a child process: the build has no GPU to keep clean.
    registry._run_in_subprocess = lambda fn: fn()
    cached: list[str] = []
    failed: dict[str, str] = {}
    for archs in _lazy_classes(registry, only).values():
        try:
            registry.ModelRegistry.models[archs[0]].inspect_model_cls()
        except Exception as error:  # noqa: BLE001 - a class vLLM itself cannot import here is skipped
            why = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            failed |= dict.fromkeys(archs, why)
        else:
            cached += archs
    return cached, failed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[], metavar="ARCH", help="these architectures alone")
    args = parser.parse_args(argv)
    cached, failed = fill(args.only)
    print(f"vLLM model info cached for {len(cached)} architectures; {len(failed)} do not import here")
    for arch, why in sorted(failed.items()):
        print(f"  not cached: {arch}: {why}")
    missing = [arch for arch in (args.only or REQUIRED) if arch not in cached]
    if missing:
        print(f"error: not cached: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
