"""What the CPU pipeline's test modules share, made once for the package: the tiny model, one engine's
greedy answers to compare with, and the empty torch.compile cache the pipelines' engines start with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.dataplane.pipeline import start_single_engine
from e2e.dataplane.prompts import ONE_TOKEN_PROMPT, PROMPTS, Answers, greedy_answers
from e2e.dataplane.tiny_model import build


@pytest.fixture(scope="package")
def cold_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The engines start with an empty torch.compile cache, as a new pod does: a kernel compiled on a
    request's path (seconds) then shows as a failed transfer here, not only on a fresh machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
        yield


@pytest.fixture(scope="package")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="package")
def reference(model: Path, cold_compile_cache: None, tmp_path_factory: pytest.TempPathFactory) -> Answers:
    """Greedy outputs of one engine serving alone (stopped before any pipeline starts: 2 cores)."""
    single = start_single_engine(model, tmp_path_factory.mktemp("single"))
    try:
        return greedy_answers(single.url, [*PROMPTS, ONE_TOKEN_PROMPT])
    finally:
        single.stop()
