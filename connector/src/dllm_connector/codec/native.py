"""The host KV codec kernels in C (kvcodec.c): compiled for this CPU at first use, loaded by ctypes.

native_kernels runs them on host tensors; they write the same bytes as its torch kernels, about twice as
fast on one core as torch.compile's (docs/kv-connector.md). No torch here: images build the library
in a stage without it. The library is built once per source, compiler and CPU into a private cache
directory (DLLM_KV_CODEC_CACHE, else ~/.cache/dllm-connector), or taken ready-made from
DLLM_KV_CODEC_LIBRARY (images build one for the architecture's baseline CPU); dllm_connector.tuning
reads both variables, the caller passes the paths. Without a C compiler,
`load` returns None and the torch kernels stay in use.

    python .../dllm_connector/codec/native.py OUT.so [--march baseline]   # build one ahead of time

Run as a file, not with -m: importing the codec package would import torch, which the images' build
stage does not have.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["NativeCodec", "build", "load"]

_log = logging.getLogger(__name__)
# No fused multiply-add (its one rounding differs from torch's two); no trapping math, so the
# element loops' selects vectorize. Neither changes a result.
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-std=c11", "-fPIC")
# What a ready-made library is built for (`--march baseline`): a CPU every server of its
# architecture has, named by platform.machine().
_BASELINES = {"x86_64": "x86-64-v3", "amd64": "x86-64-v3", "aarch64": "armv8-a", "arm64": "armv8-a"}
# What an x86-64-v3 build needs of the CPU that loads it (a missing one would be SIGILL, not an error).
_X86_64_V3_FLAGS = frozenset({"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"})
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class NativeCodec:
    """The four entry points of a loaded kvcodec library, on raw addresses (native_kernels passes tensors'):
    rows and codes of `nrows` x `length` elements, one float32 scale per row; `dtype` numbers the
    KV dtype as kvcodec.c does (0 bfloat16, 1 float16, 2 float32)."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._encode = {True: library.dllm_fp8_encode, False: library.dllm_int8_encode}
        self._fp8_decode, self._int8_decode = library.dllm_fp8_decode, library.dllm_int8_decode
        for encode in self._encode.values():
            encode.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _PTR, _PTR]
        self._fp8_decode.argtypes = [ctypes.c_int, _PTR, _PTR, _I64, _I64, ctypes.c_float, _PTR]
        self._int8_decode.argtypes = [ctypes.c_int, _PTR, _PTR, _I64, _I64, _PTR]
        for function in (*self._encode.values(), self._fp8_decode, self._int8_decode):
            function.restype = ctypes.c_int

    def encode(
        self, fp8: bool, dtype: int, rows: int, nrows: int, length: int, codes: int, scales: int
    ) -> None:
        """Rows -> their codes (uint8 e4m3 or int8) and scales."""
        self._check(self._encode[fp8](dtype, rows, nrows, length, codes, scales), dtype)

    def decode(
        self, fp8: bool, dtype: int, codes: int, scales: int, nrows: int, length: int, limit: float, out: int
    ) -> None:
        """Codes and their rows' scales -> values of `dtype` at out (fp8: within +-limit)."""
        if fp8:
            status = self._fp8_decode(dtype, codes, scales, nrows, length, limit, out)
        else:
            status = self._int8_decode(dtype, codes, scales, nrows, length, out)
        self._check(status, dtype)

    @staticmethod
    def _check(status: int, dtype: int) -> None:
        if status != 0:
            raise ValueError(f"kvcodec: no kernels for dtype number {dtype}")


def _source() -> bytes:
    return Path(__file__).with_name("kvcodec.c").read_bytes()


def source_sha256() -> str:
    """What a library built from this package's kvcodec.c reports (`dllm_kvcodec_source`)."""
    return hashlib.sha256(_source()).hexdigest()


def _compiler() -> list[str]:
    """The C compiler's command: $CC as a shell would split it (e.g. `ccache gcc`), else cc or gcc."""
    configured = os.environ.get("CC")
    if configured:
        return shlex.split(configured)
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC) to build the KV codec kernels")
    return [found]


def _march(requested: str) -> str:
    """The -march value: as given, or for `baseline` this architecture's (see _BASELINES)."""
    if requested != "baseline":
        return requested
    machine = platform.machine()
    if machine.lower() not in _BASELINES:
        raise ValueError(f"no baseline CPU for {machine}: name one with --march")
    return _BASELINES[machine.lower()]


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def build(out: Path, march: str = "native", compiler: list[str] | None = None) -> Path:
    """Compile kvcodec.c for `march` (a gcc -march value, or `baseline`) into `out` (written whole,
    then renamed into place); raises OSError, ValueError or CalledProcessError (with the compiler's
    message) on failure."""
    compiler = compiler or _compiler()
    march = _march(march)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        source, partial = Path(scratch, "kvcodec.c"), Path(scratch, out.name)
        source.write_bytes(_source())
        stamp = f'-DKVCODEC_SOURCE_SHA256="{source_sha256()}"'
        command = [*compiler, f"-march={march}", *_FLAGS, stamp, "-shared", "-o", str(partial), str(source)]
        subprocess.run([*command, "-lm"], check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, out)
    return out


def _untrusted_part(directory: Path) -> Path | None:
    """The first part of `directory`'s path that someone else could change, or None.

    Like ssh's StrictModes: the directory is not a symlink and is this user's, writable by no one
    else; every parent (symlinks resolved) is root's or this user's and writable by no one else, or
    sticky (/tmp: others cannot rename or replace what is ours inside it)."""
    uid = os.getuid()
    leaf = directory.lstat()
    if stat.S_ISLNK(leaf.st_mode) or leaf.st_uid != uid or leaf.st_mode & 0o022:
        return directory
    for part in directory.resolve().parents:
        status = part.stat()
        if status.st_uid not in (0, uid) or (status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX):
            return part
    return None


def _private_cache(configured: Path | None) -> Path:
    """The cache directory (`configured`, else the XDG cache's dllm-connector), if only this user can
    change it or its path; else a fresh private temporary one (a library someone else could replace
    must never be loaded)."""
    xdg_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = configured or xdg_cache / "dllm-connector"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        untrusted = _untrusted_part(directory)
        if untrusted is None:
            return directory
        _log.warning(
            "KV codec cache %s: %s could be changed by others; building in a private temporary one",
            directory,
            untrusted,
        )
    except OSError as error:
        _log.warning("KV codec cache %s is unusable (%s); building in a temporary one", directory, error)
    return Path(tempfile.mkdtemp(prefix="dllm-kvcodec-"))


def _open(path: Path, owners: frozenset[int] | None = None) -> NativeCodec:
    """The library at `path`, if it is a regular file of one of `owners` (default: this user) that no
    one else can write, built from this package's source; else OSError.

    The checked file is the loaded one: it is opened once without following symlinks, and dlopen is
    given that descriptor, so nothing can be swapped in between (a library's constructors run at
    load, before any check of what it reports)."""
    allowed = owners if owners is not None else frozenset({os.getuid()})
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_uid not in allowed or status.st_mode & 0o022:
            raise OSError(f"{path} is not a file that only its owner (uid {sorted(allowed)}) can write")
        library = ctypes.CDLL(f"/proc/self/fd/{descriptor}")
    except BaseException:
        os.close(descriptor)
        raise
    # The descriptor stays open while the library is loaded, for good: the dynamic loader knows a
    # loaded object by its name, and a reused /proc/self/fd/N would be taken for the earlier library.
    try:
        reported = library.dllm_kvcodec_source
    except AttributeError:
        raise OSError(f"{path} is no KV codec library of this version") from None
    reported.restype = ctypes.c_char_p
    if reported() != source_sha256().encode():
        raise OSError(f"{path} was built from another kvcodec.c than this package's")
    return NativeCodec(library, path)


def _from_cache(cache: Path | None) -> NativeCodec:
    """Built once per source, compiler and CPU; a cached library that does not load is built again."""
    compiler = _compiler()
    key = hashlib.sha256()
    for part in (
        _source(),
        " ".join(compiler).encode(),
        " ".join(_FLAGS).encode(),
        platform.machine().encode(),
    ):
        key.update(part)
    key.update(" ".join(sorted(_cpu_flags())).encode())
    path = _private_cache(cache) / f"kvcodec-{key.hexdigest()[:16]}.so"
    if path.exists():
        try:
            return _open(path)
        except OSError as error:
            _log.warning("rebuilding the KV codec kernels: %s", error)
    return _open(build(path, compiler=compiler))


def _ready_made(configured: Path) -> NativeCodec | None:
    """The library at `configured` (what images ship), where it exists, matches this package's source
    and this CPU can run it (an x86-64-v3 build needs AVX2 and the rest); else None, with a warning."""
    if platform.machine() in ("x86_64", "AMD64") and not _cpu_flags() >= _X86_64_V3_FLAGS:
        _log.warning("this CPU lacks x86-64-v3 (AVX2); not loading %s", configured)
        return None
    try:  # images install it as root; the engine runs as another user
        return _open(configured, owners=frozenset({0, os.getuid()}))
    except OSError as error:
        _log.warning("not using DLLM_KV_CODEC_LIBRARY: %s", error)  # where images and users name it
        return None


def load(library: Path | None = None, cache: Path | None = None) -> NativeCodec | None:
    """The kernels: the ready-made `library` where given and usable, else built here into `cache`
    (see _private_cache); None (and a warning saying why) where neither works."""
    try:
        return (library and _ready_made(library)) or _from_cache(cache)
    except subprocess.CalledProcessError as error:
        _log.warning("building the KV codec kernels failed: %s", error.stderr.strip()[-2000:])
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        _log.warning("the native KV codec kernels are unavailable: %s", error)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the KV codec kernels ahead of time.")
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--march",
        default="native",
        help="the CPU to build for: a gcc -march value, or `baseline` (x86-64-v3 on x86-64, armv8-a "
        "on arm64: what images ship); default: this one",
    )
    args = parser.parse_args(argv)
    try:
        print(build(args.out, args.march))
    except subprocess.CalledProcessError as error:
        sys.exit(f"building the KV codec kernels failed:\n{error.stderr}")
    except (OSError, ValueError) as error:
        sys.exit(f"building the KV codec kernels failed: {error}")


if __name__ == "__main__":
    main()
