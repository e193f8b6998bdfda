"""The GPU check of issue 20: the KV codec and checksum on the device, in one run of under 5 minutes.

On a realistic KV (32 layers, 8 KV heads, head_dim 128, block size 16, bf16; 2k and 32k tokens) it
reports, as one JSON document on stdout and a short table on stderr:

    codec           encode and decode GB/s of uncompressed KV for fp8 and int8 on the device, per
                    kernel set (plain torch ops; torch.compile, i.e. Triton on a GPU), checksum
                    included, called as the pipe calls them (one layer per part) and whole (one
                    call per batch); goal: 500 GB/s each on an H200
    checksum        the nh64 device checksum's GB/s (eager torch ops and compiled)
    equality        device kernels against the host's native C kernels on the same KV, copied to the
                    host: codes and scales, decoded values, and nh64 on both sides, bit for bit
    host syncs      how many times one batch's encode and one streamed decode wait for the device
    copies          device -> pinned host and back (non_blocking), and device -> pageable host
    mooncake        one process to another through the transfer engine (device memory, where its
                    build has CUDA; else it says why it skipped; host memory on --device cpu)

It exits 1 when any equality fails, 2 when the environment cannot run it. Nothing is downloaded:
torch (and Triton) must be there; the project's pure dependencies (pydantic, xxhash) come from
`--wheels DIR` if not installed (pip installs them from that directory only).

    python bench/gpu_check.py                              # on a GPU: 2k and 32k tokens
    python bench/gpu_check.py --device cpu --quick         # here: small sizes, the same code paths
    python bench/gpu_check.py --json "$OUT/gpu_check.json" --wheels build/gpu-wheels

On the lent H200 (Python 3.12, torch 2.11, no pydantic, no Mooncake): build/gpu-wheels (ignored by
git; carry it) holds pydantic 2.14.3 with pydantic_core, annotated-types, typing-inspection and
typing_extensions for cp312, and mooncake-transfer-engine-cuda13 0.3.14 (47 MiB), fetched with pip
download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux...x86_64.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
GOAL_GBPS = 500.0
COPY_BYTES_MAX = 1 << 30
SPAN_BYTES = BLOCK * KV_HEADS * HEAD_DIM * 2  # one block's K or V in vLLM's GPU layout: 32 KiB
SPAN_SAMPLE = 512
MOONCAKE_TIMEOUT_S = 60.0
PINS = {"pydantic": "requirements/dev.in", "xxhash": "requirements/engine.in"}


# ---- environment ---------------------------------------------------------------------------------


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


# ---- measuring -----------------------------------------------------------------------------------


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(run: Callable[[], object], device: Any, repeats: int) -> float:
    """Median wall time of `run` after one warm-up call, the device idle before and after each."""
    run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, elapsed: float) -> float:
    return round(nbytes / elapsed / 1e9, 3)


def make_kv(tokens: int, device: Any) -> Any:
    """The KV of `tokens` gathered as the pipe gathers a batch: [layers * blocks * (K, V), heads,
    block, head_dim], one scale group per (block, head, K or V)."""
    import torch

    blocks = -(-tokens // BLOCK)
    generator = torch.Generator(device=device).manual_seed(tokens)
    shape = (LAYERS * blocks * 2, KV_HEADS, BLOCK, HEAD_DIM)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)


def count_syncs(run: Callable[[], object], device: Any) -> int | None:
    """Host syncs during `run` (CUDA's sync debug mode: one warning per synchronizing call)."""
    import torch

    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


# ---- the checks ----------------------------------------------------------------------------------


def passes(device: Any, quick: bool, compiled: bool) -> list[tuple[str, str]]:
    """(codec kernel set, checksum kernel) per pass: plain torch ops first, so that a run cut short
    still has them; then torch.compile's (skipped by --no-compiled, and by --quick on a CPU, where
    compiling takes a minute of two cores)."""
    plain = [("plain", "eager")]
    return plain if not compiled or (quick and device.type == "cpu") else [*plain, ("compiled", "compiled")]


def label(used: str, device: Any) -> str:
    """The set that ran: the native set runs plain torch ops on a device (where compiled was asked
    for and is unavailable, the next set serves, and says so in a warning)."""
    return "plain" if used == "native" and device.type != "cpu" else used


def codec_rows(kv: Any, device: Any, name: str, repeats: int) -> list[dict[str, Any]]:
    from dllm_connector import codec
    from dllm_contract.kvconfig import Compression

    started = time.perf_counter()
    used = label(codec.use_kernels(name), device)  # compiled: checked on the host first
    setup_s = round(time.perf_counter() - started, 2)
    rows = [
        codec_row(kv, device, compression, repeats) | {"kernels": used, "kernel_setup_s": setup_s}
        for compression in (Compression.FP8, Compression.INT8)
    ]
    codec.use_kernels("native")
    return rows


def codec_row(kv: Any, device: Any, compression: Any, repeats: int) -> dict[str, Any]:
    """One codec with the kernels in use: encode and decode per layer (as the pipe calls them) and
    whole, the nh64 checksum included in both."""
    import torch

    from dllm_connector import codec

    shape, raw = tuple(kv.shape), kv.numel() * kv.element_size()
    nbytes = codec.payload_nbytes(compression, kv.dtype, shape, KV_HEADS)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(kv)

    def encode(parts: Any) -> Any:
        return codec.encode_parts(
            parts, shape, kv.dtype, compression, KV_HEADS, out, checksum_algo=codec.ChecksumAlgo.NH64
        )

    started = time.perf_counter()
    header, payload = encode(kv.chunk(LAYERS))
    first_call_s = time.perf_counter() - started

    def decode_layers() -> None:
        stream = codec.StreamingDecode(header, payload, LAYERS)
        for index, part in enumerate(stream.parts_until(LAYERS)):
            target[index * part.shape[0] : (index + 1) * part.shape[0]].copy_(part)
        stream.verify(header.checksum, header.checksum_algo)

    from dllm_connector import device_checksum

    checksum_kernel = "eager" if device_checksum.kernel(device) is device_checksum.terms_sum else "compiled"
    return {
        "codec": compression.value,
        "checksum_kernel": checksum_kernel,  # nh64's, chosen by default ("auto")
        "first_call_s": round(first_call_s, 2),  # compiles for this device, if any
        "encode_layers_gbps": gbps(raw, seconds(lambda: encode(kv.chunk(LAYERS)), device, repeats)),
        "encode_whole_gbps": gbps(raw, seconds(lambda: encode([kv]), device, repeats)),
        "decode_layers_gbps": gbps(raw, seconds(decode_layers, device, repeats)),
        "decode_whole_gbps": gbps(
            raw, seconds(lambda: codec.decode(header, payload, target), device, repeats)
        ),
        "encode_syncs": count_syncs(lambda: encode(kv.chunk(LAYERS)), device),
        "decode_syncs": count_syncs(decode_layers, device),
    }


def with_edge_groups(sample: Any) -> Any:
    """A copy with groups of each kind the kernels treat apart: zeros, subnormals, the dtype's
    largest values and powers of two (every other group random)."""
    import torch

    sample = sample.clone()
    info = torch.finfo(sample.dtype)
    ramp = torch.linspace(-1.0, 1.0, BLOCK * HEAD_DIM, device=sample.device).view(BLOCK, HEAD_DIM)
    sample[0, 0] = 0.0
    sample[1, 1] = ramp * info.tiny
    sample[2, 2] = ramp * info.max
    powers = 2.0 ** torch.arange(-8, 8, device=sample.device).float()
    sample[3, 3] = powers.repeat(HEAD_DIM).view(BLOCK, HEAD_DIM)
    return sample


def equality_rows(kv: Any, device: Any, name: str) -> list[dict[str, Any]]:
    """Device kernels against the host's on one sample of the KV (the first two layers' worth)."""
    import torch

    from dllm_connector import codec, device_checksum
    from dllm_contract.kvconfig import Compression

    sample = with_edge_groups(kv[: max(4, kv.shape[0] * 2 // LAYERS)])
    host_sample, shape = sample.cpu(), tuple(sample.shape)
    reference = codec.use_kernels("native")  # the C kernels, where they build here
    expected = {}
    for compression in (Compression.FP8, Compression.INT8):
        header, payload = codec.encode(host_sample, compression, KV_HEADS)
        expected[compression] = (payload.clone(), codec.decode(header, payload))
    rows = []
    used = label(codec.use_kernels(name), device)
    for compression in (Compression.FP8, Compression.INT8):
        out = torch.empty(
            codec.payload_nbytes(compression, kv.dtype, shape, KV_HEADS), dtype=torch.uint8, device=device
        )
        header, payload = codec.encode_parts(
            [sample], shape, kv.dtype, compression, KV_HEADS, out, checksum_algo=codec.ChecksumAlgo.NH64
        )
        values = codec.decode(header, payload)
        host_payload, host_values = expected[compression]
        on_host = payload.cpu()
        rows.append(
            {
                "kernels": used,
                "reference": reference,
                "codec": compression.value,
                "bytes": int(on_host.numel()),
                "payload_equal": bool(torch.equal(on_host, host_payload)),
                "decoded_equal": bool(
                    torch.equal(values.cpu().view(torch.uint8), host_values.view(torch.uint8))
                ),
                "checksum_equal": header.checksum == codec.checksum(header, on_host)
                and device_checksum.tensor_checksum(payload) == device_checksum.tensor_checksum(on_host),
            }
        )
    codec.use_kernels("native")
    return rows


def checksum_rows(kv: Any, device: Any, name: str, repeats: int) -> list[dict[str, Any]]:
    """nh64 over the KV as one run, and over its 32 KiB block spans in scattered order (a zero-copy
    transfer's checksum): through add_all, and one add per span (on the first SPAN_SAMPLE spans)."""
    from dllm_connector import device_checksum

    data = kv.view(-1).view(__import__("torch").uint8)
    spans = list(data.view(-1, SPAN_BYTES).unbind(0))[::-1]
    sample = spans[:SPAN_SAMPLE]
    device_checksum.use_kernel(name)
    started = time.perf_counter()
    value = device_checksum.tensor_checksum(data)
    first_call_s = round(time.perf_counter() - started, 2)

    def by_spans(pieces: list[Any], each: bool) -> int:
        running = device_checksum.RunningTensorChecksum()
        if each:
            for piece in pieces:
                running.add(piece)
        else:
            running.add_all(pieces)
        return running.value

    row = {
        "kernel": name,
        "first_call_s": first_call_s,
        "gbps": gbps(data.numel(), seconds(lambda: device_checksum.tensor_checksum(data), device, repeats)),
        "spans_add_all_gbps": gbps(data.numel(), seconds(lambda: by_spans(spans, False), device, repeats)),
        "spans_each_gbps": gbps(
            len(sample) * SPAN_BYTES, seconds(lambda: by_spans(sample, True), device, repeats)
        ),
        "value": f"{value:#018x}",
    }
    device_checksum.use_kernel("auto")
    return [row]


def copy_rows(kv: Any, device: Any, repeats: int) -> dict[str, Any]:
    import torch

    if device.type == "cpu":
        return {"skipped": "no device: the CPU is the host"}
    source = kv.view(-1).view(torch.uint8)[:COPY_BYTES_MAX]
    pinned = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(source.numel(), dtype=torch.uint8)
    back = torch.empty_like(source)
    row = {
        "bytes": int(source.numel()),
        "to_pinned_gbps": gbps(
            source.numel(), seconds(lambda: pinned.copy_(source, non_blocking=True), device, repeats)
        ),
        "from_pinned_gbps": gbps(
            source.numel(), seconds(lambda: back.copy_(pinned, non_blocking=True), device, repeats)
        ),
        "to_pageable_gbps": gbps(source.numel(), seconds(lambda: pageable.copy_(source), device, repeats)),
    }
    row["round_trip_equal"] = bool(torch.equal(back, source))
    return row


# ---- one process to another through Mooncake ----------------------------------------------------


def _engine(host: str) -> Any:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake initialize failed")
    return engine


def mooncake_receiver(device_name: str, nbytes: int) -> None:
    """The other process: registers a buffer on the device, names it, and hashes it when told."""
    import torch

    from dllm_connector import device_checksum

    engine = _engine("127.0.0.1")
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device_name)
    location = "cpu:0" if buffer.device.type == "cpu" else f"cuda:{buffer.device.index or 0}"
    if engine.register_memory(buffer.data_ptr(), nbytes, location) != 0:
        raise RuntimeError("Mooncake could not register the receiver's buffer")
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    print(json.dumps({"session": session, "addr": buffer.data_ptr()}), flush=True)
    sys.stdin.readline()  # the sender's writes are done
    print(json.dumps({"checksum": device_checksum.tensor_checksum(buffer)}), flush=True)


def mooncake_row(device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    try:
        import mooncake.engine as engine_module
    except ImportError as error:
        return {"skipped": f"mooncake.engine does not import: {error}"}
    if device.type == "cuda" and not getattr(engine_module, "SUPPORT_CUDA", False):
        return {
            "skipped": "mooncake.engine is a build without CUDA (SUPPORT_CUDA false): "
            "device memory cannot be registered"
        }
    command = [sys.executable, __file__, "--mooncake-receiver", str(device), "--bytes", str(nbytes)]
    receiver = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        return _send_to(receiver, device, nbytes, repeats)
    except Exception as error:  # noqa: BLE001 - reported in the row; the rest of the check stands
        return {"skipped": f"failed: {type(error).__name__}: {error}"}
    finally:
        receiver.kill()
        receiver.wait(timeout=30)


def _line(receiver: subprocess.Popen[str], timeout_s: float = MOONCAKE_TIMEOUT_S) -> dict[str, Any]:
    """The receiver's next JSON line, or {} if none comes within the timeout."""
    assert receiver.stdout is not None
    ready, _, _ = select.select([receiver.stdout], [], [], timeout_s)
    line = receiver.stdout.readline() if ready else ""
    return dict(json.loads(line)) if line.strip() else {}


def _send_to(receiver: subprocess.Popen[str], device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    import torch

    from dllm_connector import device_checksum

    assert receiver.stdin is not None
    peer = _line(receiver)
    if "session" not in peer:
        return {"skipped": "the receiving process did not start (see stderr)"}
    engine = _engine("127.0.0.1")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    location = "cpu:0" if device.type == "cpu" else f"cuda:{device.index or 0}"
    if engine.register_memory(data.data_ptr(), nbytes, location) != 0:
        return {"skipped": "Mooncake could not register the sender's buffer"}

    def write() -> None:
        if engine.transfer_sync_write(peer["session"], data.data_ptr(), peer["addr"], nbytes) != 0:
            raise RuntimeError("Mooncake transfer_sync_write failed")

    elapsed = seconds(write, device, repeats)
    receiver.stdin.write("done\n")
    receiver.stdin.flush()
    theirs = _line(receiver).get("checksum")
    return {
        "memory": "device" if device.type == "cuda" else "host",
        "protocol": "tcp",
        "bytes": nbytes,
        "gbps": gbps(nbytes, elapsed),
        "checksum_equal": theirs == device_checksum.tensor_checksum(data),
    }


# ---- report ---------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']}  torch {report['torch']}  triton {report['triton']}"]
    for size in report["sizes"]:
        lines.append(f"-- {size['tokens']} tokens, {size['kv_bytes'] / 1e9:.3f} GB of KV")
        lines.append(
            "   kernels   codec  GB/s: encode layers / whole, decode layers / whole; syncs enc / dec"
        )
        for row in size["codec"]:
            encode = f"{row['encode_layers_gbps']:9.2f} / {row['encode_whole_gbps']:<9.2f}"
            decode = f"{row['decode_layers_gbps']:9.2f} / {row['decode_whole_gbps']:<9.2f}"
            syncs = f"{row['encode_syncs']} / {row['decode_syncs']}"
            lines.append(f"   {row['kernels']:9s} {row['codec']:5s}  {encode} {decode} {syncs}")
        for row in size["checksum"]:
            spans = f"spans: add_all {row['spans_add_all_gbps']:.2f}, each {row['spans_each_gbps']:.2f}"
            lines.append(f"   checksum {row['kernel']:8s} {row['gbps']:.2f} GB/s; {spans}")
        for row in size["equality"]:
            same = row["payload_equal"] and row["decoded_equal"] and row["checksum_equal"]
            lines.append(f"   equal to {row['reference']}: {row['kernels']} {row['codec']}: {same}")
        lines.append(f"   copies: {size['copies']}")
    lines.append(f"mooncake: {report['mooncake']}")
    lines.append(f"all equal: {report['all_equal']}  (goal {GOAL_GBPS} GB/s encode and decode on an H200)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="256 tokens, 2 repeats: a smoke run")
    parser.add_argument("--tokens", type=int, nargs="+", help="default 2048 32768 (--quick: 256)")
    parser.add_argument("--repeats", type=int, help="timed calls per figure (median); default 5, --quick 2")
    parser.add_argument("--json", help="also write the JSON document here (after each step)")
    parser.add_argument("--no-compiled", action="store_true", help="plain torch ops and eager checksum only")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="past this many seconds, the compiled pass's remaining sizes are skipped (default 200)",
    )
    parser.add_argument("--wheels", help="a directory of wheels for missing pure dependencies")
    parser.add_argument("--mooncake-receiver", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    reason = prepare_imports(args.wheels)
    if args.mooncake_receiver:
        mooncake_receiver(args.mooncake_receiver, args.bytes)
        return 0
    if reason is not None:
        print(json.dumps({"error": reason}))
        return 2
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device is visible to torch"}))
        return 2
    tokens = args.tokens or ([256] if args.quick else [2048, 32768])
    repeats = args.repeats or (2 if args.quick else 5)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": importlib.util.find_spec("triton") is not None,
        "goal_gbps": GOAL_GBPS,
        "sizes": [{"tokens": count, "codec": [], "checksum": [], "equality": []} for count in tokens],
        "mooncake": {"skipped": "not reached"},
    }

    def save(step: str) -> None:
        """The report so far, where --json says (a run cut short keeps what it measured)."""
        report["seconds"] = round(time.perf_counter() - started, 1)
        rows = [row for size in report["sizes"] for row in size["equality"]]
        report["all_equal"] = bool(rows) and all(
            row["payload_equal"] and row["decoded_equal"] and row["checksum_equal"] for row in rows
        )
        print(f"[{report['seconds']:7.1f} s] {step}", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    skipped: list[str] = []
    for number, (kernels, checksum_kernel) in enumerate(passes(device, args.quick, not args.no_compiled)):
        for size in report["sizes"]:
            if number and time.perf_counter() - started > args.budget_s:
                skipped.append(f"{size['tokens']} tokens, {kernels} kernels")
                continue
            kv = make_kv(size["tokens"], device)
            size["kv_bytes"] = kv.numel() * kv.element_size()
            size["equality"] += equality_rows(kv, device, kernels)
            size["codec"] += codec_rows(kv, device, kernels, repeats)
            size["checksum"] += checksum_rows(kv, device, checksum_kernel, repeats)
            if number == 0:
                size["copies"] = copy_rows(kv, device, repeats)
            del kv
            save(f"{size['tokens']} tokens, {kernels} kernels")
        if number == 0:
            payload_bytes = min(COPY_BYTES_MAX, report["sizes"][0]["kv_bytes"])
            report["mooncake"] = mooncake_row(device, payload_bytes, repeats)
            save("mooncake")
    if skipped:
        report["skipped_for_time"] = skipped
        save(f"past --budget-s {args.budget_s:.0f}: skipped {', '.join(skipped)}")
    print(table(report), file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
