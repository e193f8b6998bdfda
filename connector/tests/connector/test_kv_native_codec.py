"""The C codec kernels: built once per CPU into a private cache, or taken ready-made; where they
cannot be built the torch kernels serve, with a warning that says why. (That they write the torch
kernels' bytes is test_kv_codec_kernels's test_kernels_match_plain_ones_bit_for_bit.)"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dllm_connector import codec, tuning
from dllm_connector.codec import kernel_sets as codec_kernels
from dllm_connector.codec import native as native_codec
from dllm_connector.codec.native_kernels import native_kernels
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def compiler() -> str:
    """The system C compiler, which `tools/system-deps.sh engine` installs: missing, the test fails."""
    assert COMPILER is not None, "no C compiler (cc or gcc): run tools/system-deps.sh engine"
    return COMPILER


needs_compiler = pytest.mark.usefixtures("compiler")


@pytest.fixture(autouse=True)
def _default_kernels_afterwards() -> Iterator[None]:
    yield
    codec.configure(codec.KernelRequest())
    codec.use_kernels("native")


@pytest.fixture(autouse=True)
def fallback_builds_stay_in_the_tests_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused cache makes the loader build in a fresh temporary directory: this test's, not /tmp."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache of this test's own (DLLM_KV_CODEC_CACHE), for the kernels chosen here too."""
    directory = tmp_path / "cache"
    codec.configure(codec.KernelRequest(cache=directory))
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
    first = native_codec.load(cache=cache)
    second = native_codec.load(cache=cache)
    assert first is not None
    assert second is not None
    assert first.path == second.path
    assert first.path.parent == cache
    assert log.read_text().splitlines() == ["run"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_without_a_compiler_plain_torch_serves_and_a_warning_says_why(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No C compiler: torch.compile, the next choice, needs one too; this machine has one, so for
    torch.compile its absence is simulated (the compiled set reported unavailable)."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(codec_kernels, "_compiled_set", lambda: None)
    with caplog.at_level(logging.WARNING, logger="dllm_connector.codec.native"):
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
    with caplog.at_level(logging.WARNING, logger="dllm_connector.codec.native"):
        assert native_codec.load(cache=cache) is None
    assert "building the KV codec kernels failed: kvcodec.c:1: error: this compiler is broken" in caplog.text
    assert not list(cache.glob("*.so")), "no partial library is left to be loaded later"


@needs_compiler
def test_a_cache_that_others_can_write_to_is_never_used(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache.mkdir()
    cache.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="dllm_connector.codec.native"):
        library = native_codec.load(cache=cache)
    assert library is not None
    assert library.path.parent != cache
    assert not list(cache.iterdir())
    assert "could be changed by others" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's takes root")
def test_a_cached_library_another_user_owns_is_built_again_not_loaded(cache: Path) -> None:
    """Review L4: only a file this user owns is loaded from the cache."""
    first = native_codec.load(cache=cache)
    assert first is not None
    os.chown(first.path, 65534, 65534)
    again = native_codec.load(cache=cache)
    assert again is not None
    assert again.path == first.path
    assert first.path.stat().st_uid == os.getuid(), "rebuilt in place by this user"


def test_a_symlinked_cache_or_one_under_a_directory_others_can_write_is_not_used(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # not sticky: anyone could rename the cache inside it
    for directory in (link, open_parent / "cache"):
        assert native_codec._private_cache(directory) != directory


# What the images' build stage runs: native.py as a file, in an interpreter where torch cannot be
# imported (that stage has none).
_RUN_WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def build_with_the_cli(out: Path, march: str) -> subprocess.CompletedProcess[str]:
    script = str(Path(native_codec.__file__))
    command = [sys.executable, "-c", _RUN_WITHOUT_TORCH, script, str(out), "--march", march]
    return subprocess.run(command, capture_output=True, text=True, check=False)


@needs_compiler
def test_a_library_built_ahead_of_time_is_loaded_from_dllm_kv_codec_library(
    cache: Path, tmp_path: Path
) -> None:
    """What images do: build for the architecture's baseline CPU at image build time, name it in
    the environment (which the engine's tuning reads)."""
    out = tmp_path / "kvcodec-baseline.so"
    built = build_with_the_cli(out, "baseline")
    assert built.returncode == 0, built.stderr
    chosen = tuning.from_env({"DLLM_KV_CODEC_LIBRARY": str(out), "DLLM_KV_CODEC_CACHE": str(cache)})
    codec.configure(codec.KernelRequest.of(chosen))
    library = native_codec.load(chosen.codec_library, chosen.codec_cache)
    assert library is not None
    assert library.path == out
    assert codec.use_kernels("native") == "native"
    assert not cache.exists(), "nothing was built"
    assert round_trip_matches_plain(Compression.FP8)


def test_an_architecture_without_a_baseline_cpu_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    out = tmp_path / "kvcodec.so"
    with pytest.raises(ValueError, match="no baseline CPU for riscv64: name one with --march"):
        native_codec.build(out, "baseline", compiler=["/nonexistent/cc"])
    assert not out.exists()


@needs_compiler
def test_building_for_an_unknown_cpu_fails_clearly(tmp_path: Path) -> None:
    out = tmp_path / "kvcodec.so"
    built = build_with_the_cli(out, "no-such-cpu")
    assert built.returncode != 0
    assert "building the KV codec kernels failed" in built.stderr
    assert "no-such-cpu" in built.stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_where_the_c_kernels_cannot_be_built_torch_compile_is_next(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if COMPILER is None:
        pytest.skip("no C compiler here: torch.compile is unavailable too")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert codec.use_kernels("native") == "compiled"


def test_an_unknown_kernel_set_name_warns_and_the_default_serves(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dllm_connector.codec"):
        in_use = codec.use_kernels("fast")
    assert "DLLM_KV_CODEC_KERNELS=fast is none of native, compiled, plain" in caplog.text
    assert in_use == ("native" if COMPILER else "plain")


@needs_compiler
@pytest.mark.parametrize(
    "odd_rows",
    [
        pytest.param(lambda rows: torch._neg_view(rows.neg()), id="lazily negated view"),
        pytest.param(lambda rows: rows.t().contiguous().t(), id="non-contiguous"),
    ],
)
def test_tensors_the_c_kernels_cannot_take_as_they_are_go_to_torch(
    odd_rows: Callable[[torch.Tensor], torch.Tensor], cache: Path
) -> None:
    """A view whose memory is not the values in row order must not be read as if it were."""
    library = native_codec.load(cache=cache)
    assert library is not None
    native = native_kernels(library)[Compression.FP8]
    rows = torch.randn(16, 64).to(torch.bfloat16)
    view = odd_rows(rows)
    assert torch.equal(view, rows)
    codes, scales = torch.empty(16, 64, dtype=torch.uint8), torch.empty(16)
    native.encode_into(view, codes, scales)
    expected_codes, expected_scales = torch.empty(16, 64, dtype=torch.uint8), torch.empty(16)
    native.encode_into(rows, expected_codes, expected_scales)
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales, expected_scales)


def load_in_a_new_process(cache: Path) -> tuple[Path, str]:
    """native_codec.load() in a fresh interpreter (one that has loaded no library from that path yet):
    the library's path, and what it logged."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
        "from pathlib import Path\n"
        "from dllm_connector.codec import native as native_codec\n"
        "print(native_codec.load(cache=Path(sys.argv[1])).path)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(cache)], capture_output=True, text=True, check=True
    )
    return Path(done.stdout.strip()), done.stderr


@needs_compiler
def test_a_cached_library_that_does_not_load_is_built_again(cache: Path) -> None:
    path, _ = load_in_a_new_process(cache)
    path.write_bytes(b"not a shared library")
    again, logged = load_in_a_new_process(cache)
    assert again == path
    assert "rebuilding the KV codec kernels" in logged
    assert path.read_bytes().startswith(b"\x7fELF")


@needs_compiler
def test_a_ready_made_library_of_other_source_is_not_used(
    cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A library left from another version of the connector (e.g. a stale mount) is refused, and the
    kernels are built from this version's source instead."""
    stale = tmp_path / "stale.so"
    source = tmp_path / "kvcodec.c"
    source.write_bytes(native_codec._source())
    command = [
        str(COMPILER),
        "-O2",
        "-fPIC",
        "-shared",
        '-DKVCODEC_SOURCE_SHA256="0123abcd"',
        "-o",
        str(stale),
    ]
    subprocess.run([*command, str(source), "-lm"], check=True)
    with caplog.at_level(logging.WARNING, logger="dllm_connector.codec.native"):
        library = native_codec.load(stale, cache)
    assert library is not None
    assert library.path.parent == cache
    assert "built from another kvcodec.c than this package's" in caplog.text


@needs_compiler
@pytest.mark.parametrize("reason", ["missing", "cpu without x86-64-v3"])
def test_an_unusable_ready_made_library_is_passed_over_with_a_warning(
    reason: str,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CPU without AVX2 would die of SIGILL in an x86-64-v3 build; which CPU runs the test is
    simulated by the flags /proc/cpuinfo is read for."""
    ready = tmp_path / "kvcodec-v3.so"
    if reason == "missing":
        expected = "not using DLLM_KV_CODEC_LIBRARY"
    else:
        native_codec.build(ready)
        monkeypatch.setattr(native_codec, "_cpu_flags", lambda: frozenset({"sse2"}))
        monkeypatch.setattr(platform, "machine", lambda: "x86_64")
        expected = "lacks x86-64-v3"
    with caplog.at_level(logging.WARNING, logger="dllm_connector.codec.native"):
        library = native_codec.load(ready, cache)
    assert library is not None
    assert library.path.parent == cache
    assert expected in caplog.text


@needs_compiler
@pytest.mark.parametrize("compression", [Compression.FP8, Compression.INT8])
def test_the_c_kernels_split_rows_over_torch_threads_to_the_same_bytes(compression: Compression) -> None:
    """Slices of rows on three threads (an uneven split) write what one thread and plain torch write."""
    kv = torch.randn(1001, 2, 16, 64).to(torch.bfloat16)  # 2002 rows of 1024: three slices of 256k+
    assert codec.use_kernels("native") == "native"
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        header, payload = codec.encode(kv, compression, 2)
        restored = codec.decode(header, payload)
    finally:
        torch.set_num_threads(threads)
    codec.use_kernels("plain")
    expected_header, expected = codec.encode(kv, compression, 2)
    assert header == expected_header
    assert torch.equal(payload, expected)
    assert torch.equal(codec.as_bytes(restored), codec.as_bytes(codec.decode(expected_header, expected)))
