"""The C codec kernels: built once per CPU into a private cache, or taken ready-made; where they
cannot be built the torch kernels serve, with a warning that says why. (That they write the torch
kernels' bytes is test_kv_codec's test_kernels_match_plain_ones_bit_for_bit.)"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_connector import codec, native_codec
from dllm_connector.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

COMPILER = shutil.which("cc") or shutil.which("gcc")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def _default_kernels_afterwards() -> Iterator[None]:
    yield
    codec.use_kernels(os.environ.get("DLLM_KV_CODEC_KERNELS", "native"))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("DLLM_KV_CODEC_CACHE", str(directory))
    monkeypatch.delenv("DLLM_KV_CODEC_LIBRARY", raising=False)
    return directory


def counting_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A compiler that records each run in a log, then runs the real one."""
    log = tmp_path / "compiler-runs"
    wrapper = tmp_path / "cc-counting"
    wrapper.write_text(f'#!/bin/sh\necho run >> "{log}"\nexec "{COMPILER}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def round_trip_matches_plain(compression: Compression) -> bool:
    kv = torch.randn(8, 4, 16, 32).to(torch.bfloat16)
    header, payload = codec.encode(kv, compression, 4)
    restored = codec.decode(header, payload)
    codec.use_kernels("plain")
    expected_header, expected = codec.encode(kv, compression, 4)
    return (
        header == expected_header
        and torch.equal(payload, expected)
        and torch.equal(restored, codec.decode(expected_header, expected))
    )


@needs_compiler
def test_the_native_kernels_are_the_default_and_write_what_plain_torch_writes(cache: Path) -> None:
    assert codec.use_kernels("native") == "native"
    assert round_trip_matches_plain(Compression.FP8)
    codec.use_kernels("native")
    assert round_trip_matches_plain(Compression.INT8)


@needs_compiler
def test_the_library_is_built_once_and_then_reused(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper, log = counting_compiler(tmp_path)
    monkeypatch.setenv("CC", str(wrapper))
    first = native_codec.load()
    second = native_codec.load()
    assert first is not None
    assert second is not None
    assert first.path == second.path
    assert first.path.parent == cache
    assert log.read_text().splitlines() == ["run"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_without_a_compiler_plain_torch_serves_and_a_warning_says_why(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="dllm_connector.native_codec"):
        assert codec.use_kernels("native") == "plain"
    assert "native KV codec kernels are unavailable" in caplog.text
    assert "/nonexistent/cc" in caplog.text
    kv = torch.randn(4, 4, 16, 8).to(torch.bfloat16)
    restored = codec.decode(*codec.encode(kv, Compression.FP8, 4))
    assert float((restored.float() - kv.float()).abs().max()) < 0.25
    assert not list(cache.glob("*.so"))


def test_a_failing_compiler_is_reported_with_its_message(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "cc-broken"
    broken.write_text("#!/bin/sh\necho 'kvcodec.c:1: error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="dllm_connector.native_codec"):
        assert native_codec.load() is None
    assert "building the KV codec kernels failed: kvcodec.c:1: error: this compiler is broken" in caplog.text
    assert not list(cache.glob("*.so")), "no partial library is left to be loaded later"


@needs_compiler
def test_a_cache_that_others_can_write_to_is_never_used(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache.mkdir()
    cache.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="dllm_connector.native_codec"):
        library = native_codec.load()
    assert library is not None
    assert library.path.parent != cache
    assert not list(cache.iterdir())
    assert "writable by others" in caplog.text


@needs_compiler
def test_a_library_built_ahead_of_time_is_loaded_from_dllm_kv_codec_library(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What images do: build for x86-64-v3 at image build time, name it in the environment."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64-v3 is an x86-64 target")
    out = tmp_path / "kvcodec-v3.so"
    built = subprocess.run(
        [sys.executable, "-m", "dllm_connector.native_codec", str(out), "--march", "x86-64-v3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    monkeypatch.setenv("DLLM_KV_CODEC_LIBRARY", str(out))
    library = native_codec.load()
    assert library is not None
    assert library.path == out
    assert codec.use_kernels("native") == "native"
    assert not cache.exists(), "nothing was built"
    assert round_trip_matches_plain(Compression.FP8)


@needs_compiler
def test_building_for_an_unknown_cpu_fails_clearly(tmp_path: Path) -> None:
    out = tmp_path / "kvcodec.so"
    built = subprocess.run(
        [sys.executable, "-m", "dllm_connector.native_codec", str(out), "--march", "no-such-cpu"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode != 0
    assert "building the KV codec kernels failed" in built.stderr
    assert "no-such-cpu" in built.stderr
    assert not out.exists()
