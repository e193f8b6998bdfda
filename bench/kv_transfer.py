"""KV transfer benchmark: a raw TCP socket against the dllm KV pipe with codecs none, fp8 and int8.

Two processes (prefill sender, decode receiver) move a paged KV of realistic shape (32 layers,
block 16, 8 KV heads, head_dim 128, bf16, vLLM's CPU layout) block by block. Every row is measured
in the same run, side by side:

    raw socket      Python sendall/recv_into of the same number of bytes: the link's limit
    <transport> <codec>   end to end: offer, gather + encode, write, decode + scatter, ack
    mooncake <codec>, 4 writes at once   (--in-flight-rows) the same with four writes of a transfer
                    on the wire at once, as over RDMA (gpu-review item 12; one at a time over TCP)
    mooncake spans  the transfer engine alone writing the KV's block spans to decode's (no pipe)
    mooncake 1 write  the same bytes as one write from one buffer: the engine's own best (for a
                    KV larger than decode's 1 GiB staging, writes of that size)
    socket spans    the KV's block spans over one Python socket (sendmsg gathers them, recv_into
                    scatters them into decode's blocks): a transport that costs what a socket costs
    socket spans+xxh3  the same, hashing every span on both sides as the pipe's zero-copy checksum
                    does (127.0.0.1 only, as is the row above)

GB/s counts uncompressed KV delivered per second (1 GB = 1e9 bytes). The codec's own GB/s per
core is measured with torch on one thread. `--link` runs the table again over a veth pair between
two network namespaces of our own, rate-limited with tc (needs root; 127.0.0.1 stays untouched).
Transfers are pipelined in batches of --batch-tokens (transferThresholdTokens, default 1024 as in
the connector). `--checksum off` is an experiment, not a mode of the connector: it replaces the
XXH3 checksum of zero-copy transfers by 0 on both sides, to show what the checksum costs (`crc32`:
by zlib's CRC-32, the connector's checksum before XXH3). `--threads` sets the torch threads of each
engine process (default 1; the codec runs on them). Decode's block ids are prefill's reversed, so
that no two spans merge (the worst case); `--consecutive-ids` gives both the same ids, so that each
layer's spans merge into one run (the best case: a fresh engine allocates blocks in order).

    python bench/kv_transfer.py --quick            # 2k tokens, under 50 s
    python bench/kv_transfer.py --tokens 2048 32768 --link 2gbit
    python bench/kv_transfer.py --tokens 2048 --transports mooncake --link 1gbit --batch-tokens 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv.codec_speed import CodecFigures, gpu_codec
from kv.link import ADDR_DECODE, ADDR_PREFILL, NS_DECODE, NS_PREFILL, emulated_link
from kv.peer import Settings
from kv.rows import measure_link
from kv.shape import BLOCK, HEAD_DIM, KV_HEADS, LAYERS
from kv.table import print_table
from kv.worker import serve


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2k tokens, 1 timed run per row")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["mooncake", "gloo"], choices=["mooncake", "gloo"])
    parser.add_argument("--link", metavar="RATE", help="also over a tc-limited veth link, e.g. 2gbit")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="transferThresholdTokens")
    parser.add_argument(
        "--checksum",
        choices=["xxh3", "crc32", "off"],
        default="xxh3",
        help="zero-copy checksum (experiment)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    parser.add_argument(
        "--consecutive-ids",
        action="store_true",
        help="decode's block ids in prefill's order (a fresh engine's allocation), so that block spans "
        "merge; default: reversed, so that none merge",
    )
    parser.add_argument(
        "--in-flight-rows",
        action="store_true",
        help="each Mooncake pipe row again with four writes on the wire at once, as over RDMA "
        "(gpu-review item 12)",
    )
    parser.add_argument("--serve", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--buffer-mb", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.quick:
        args.tokens, args.repeats = [2048], 1  # plus the discarded warm-up run of every row
    started = time.perf_counter()
    settings = Settings(
        args.batch_tokens, args.checksum, args.threads, args.consecutive_ids, args.in_flight_rows
    )
    shape = f"{LAYERS} layers, block {BLOCK}, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16"
    codec_tokens = 1024 if args.quick else 2048
    # torch.compile's kernels side by side with the C ones (compiling them costs --quick 10-20 s)
    own = os.environ.get("DLLM_KV_CODEC_KERNELS", "native")
    codec_kernels = tuple(dict.fromkeys([own] if args.quick else [own, "compiled"]))
    codecs: CodecFigures = []
    for tokens in args.tokens:
        local = ("127.0.0.1", "127.0.0.1")
        wanted = 0 if codecs else codec_tokens
        rows, measured = measure_link(
            tokens, args.repeats, args.transports, local, (None, None), settings, wanted, codec_kernels
        )
        codecs = codecs or measured
        title = f"127.0.0.1, {tokens} tokens ({shape}; {rows[0].raw_bytes / 1e6:.0f} MB of KV)"
        ids = "consecutive" if args.consecutive_ids else "scattered"
        run = f"batches of {args.batch_tokens} tokens, checksum {args.checksum}, {args.threads} thread(s)"
        run += f", {ids} block ids"
        print_table(f"{title}, {run}", rows)
        if args.link:
            with emulated_link(args.link):
                rows, _ = measure_link(
                    tokens,
                    args.repeats,
                    args.transports,
                    (ADDR_PREFILL, ADDR_DECODE),
                    (NS_PREFILL, NS_DECODE),
                    settings,
                )
            print_table(f"veth + tc {args.link}, {tokens} tokens", rows)
    print(f"\ncodec on one core (torch threads = 1), {codec_tokens} tokens:")
    for kernels, name, encode, decode, encode_median, decode_median in codecs:
        print(
            f"  {name:<5} encode {encode:5.2f} GB/s (median {encode_median:5.2f})   "
            f"decode {decode:5.2f} GB/s (median {decode_median:5.2f})   ({kernels} kernels, best of the runs)"
        )
    gpu_codec()
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
