"""What starting a thread per Mooncake write cost, against the threads the transport keeps (gpu-review
item 12): one write of one piece at a time between two Mooncake engines on 127.0.0.1 (TCP), each way
of dispatching in turn, interleaved, for a few piece sizes.

The baseline (`thread_per_write`) is the dispatch the transport had before: a thread started per send,
handing back its result through a future; both run the transport's own batch loop. Over TCP on one host
a write of megabytes takes milliseconds and hides the dispatch; on RDMA an 8 MiB piece is a fraction of
a millisecond on the wire, where the dispatch's share is what the small pieces here show.

    .venv/bin/python bench/mooncake_dispatch.py [--rounds 7] [--writes 200]

Prints, per piece size, the median microseconds per write each way and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from dllm_connector.transport.base import Span
from dllm_connector.transport.mooncake import MooncakeTransport

HOST = "127.0.0.1"
SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def thread_per_write(source: MooncakeTransport, session: str, src: list[Span], dst: list[Span]) -> None:
    """The old dispatch: a thread started for the send, its outcome handed back through a future."""
    done: Future[None] = Future()

    def run() -> None:
        try:
            source._write_batches(session, src, dst, threading.Event(), time.monotonic() + 30)
            done.set_result(None)
        except Exception as error:  # noqa: BLE001 - handed to the caller
            done.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    done.result(timeout=30)


def kept_threads(source: MooncakeTransport, session: str, src: list[Span], dst: list[Span]) -> None:
    source.send({"session": session}, src, dst, 0, 30)


def per_write_us(
    way: Callable[[MooncakeTransport, str, list[Span], list[Span]], None],
    source: MooncakeTransport,
    session: str,
    spans: tuple[list[Span], list[Span]],
    writes: int,
) -> float:
    began = time.perf_counter()
    for _ in range(writes):
        way(source, session, *spans)
    return (time.perf_counter() - began) / writes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--writes", type=int, default=200)
    args = parser.parse_args()
    source, target = MooncakeTransport(HOST), MooncakeTransport(HOST)
    try:
        sent = torch.randint(0, 255, (max(SIZES),), dtype=torch.uint8)
        landed = torch.zeros_like(sent)
        source.register(sent)
        target.register(landed)
        print(f"{'piece':>8} | {'thread per write (us)':>21} | {'kept threads (us)':>17} | ratio")
        for size in SIZES:
            spans = [Span(sent.data_ptr(), size)], [Span(landed.data_ptr(), size)]
            # fewer of the large ones: a round of 8 MiB writes still takes tens of milliseconds
            writes = args.writes if size <= 64 << 10 else max(10, args.writes * (64 << 10) // size)
            old: list[float] = []
            new: list[float] = []
            for _ in range(args.rounds):  # interleaved: the machine's noise falls on both alike
                old.append(per_write_us(thread_per_write, source, target.session_id, spans, writes))
                new.append(per_write_us(kept_threads, source, target.session_id, spans, writes))
            assert torch.equal(landed[:size], sent[:size])
            before, after = statistics.median(old), statistics.median(new)
            print(f"{size >> 10:>6} K | {before:>21.1f} | {after:>17.1f} | {after / before:.2f}x")
    finally:
        source.close()
        target.close()


if __name__ == "__main__":
    main()
