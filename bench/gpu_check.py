"""The GPU check of issue 20: the KV codec and checksum on the device, in one run of under 5 minutes.

On a realistic KV (32 layers, 8 KV heads, head_dim 128, block size 16, bf16; 2k and 32k tokens) it
reports, as one JSON document on stdout and a short table on stderr:

    codec           encode and decode GB/s of uncompressed KV for fp8 and int8 on the device, per
                    kernel set (plain torch ops; torch.compile, i.e. Triton on a GPU), checksum
                    included, called as the pipe calls them (one layer per part) and whole (one
                    call per batch); goal: 500 GB/s each on an H200
    checksum        the nh64 device checksum's GB/s (eager torch ops and compiled); a zero-copy
                    chunk's blocks in scattered order, gathered then hashed, and read in place by the
                    Triton kernel taking block ids (gpu-review item 14), with the two values compared
    equality        device kernels against the host's native C kernels on the same KV, copied to the
                    host: codes and scales, decoded values, and nh64 on both sides, bit for bit
    host syncs      how many times one batch's encode and one streamed decode wait for the device
    copies          device -> pinned host and back (non_blocking), and device -> pageable host
    mooncake        one process to another through the transfer engine (device memory, where its
                    build has CUDA; else it says why it skipped; host memory on --device cpu)
    pipe            the connector's pipe end to end, prefill and decode sides on this one device over
                    Mooncake TCP: FlashAttention NHD, head-major HND and MLA caches, on the device path
                    (forced over TCP, DLLM_KV_TCP_DEVICE=1) and pinned-host, codecs none, fp8, int8;
                    each row checks decode's blocks against prefill's (gpu-review item 17)

It exits 1 when any equality or pipe row fails (or the in-place checksum's value differs), 2 when the
environment cannot run it. Nothing is downloaded: torch (and Triton) must be there; the project's pure
dependencies (pydantic, xxhash) come from `--wheels DIR` if not installed (pip installs them from that
directory only).

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
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.checksum_speed import checksum_rows
from gpu.codec_speed import codec_rows
from gpu.copies import COPY_BYTES_MAX, copy_rows
from gpu.environment import prepare_imports
from gpu.equality import equality_rows
from gpu.kv import make_kv
from gpu.mooncake_pair import mooncake_receiver, mooncake_row
from gpu.passes import passes
from gpu.pipe_layouts import pipe_rows
from gpu.report import GOAL_GBPS, table


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
        "pipe": [],
    }

    def save(step: str) -> None:
        """The report so far, where --json says (a run cut short keeps what it measured)."""
        report["seconds"] = round(time.perf_counter() - started, 1)
        rows = [row for size in report["sizes"] for row in size["equality"]]
        in_place = [
            row for size in report["sizes"] for row in size["checksum"] if "blocks_in_place_equal" in row
        ]
        report["all_equal"] = (
            bool(rows)
            and all(row["payload_equal"] and row["decoded_equal"] and row["checksum_equal"] for row in rows)
            and all(row["blocks_in_place_equal"] for row in in_place)
        )
        report["pipe_ok"] = all(row.get("ok", True) for row in report["pipe"])
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
            report["pipe"] = pipe_rows(device, tokens[0], 4 if args.quick else 32)
            save("pipe")
    if skipped:
        report["skipped_for_time"] = skipped
        save(f"past --budget-s {args.budget_s:.0f}: skipped {', '.join(skipped)}")
    print(table(report), file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0 if report["all_equal"] and report["pipe_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
