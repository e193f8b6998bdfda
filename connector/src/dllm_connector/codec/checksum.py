"""The KV checksum: XXH3-64 over host memory spans, read in place, in order.

XXH3 hashes several times faster per core than zlib's CRC-32, which made the checksum the largest
cost of an uncompressed transfer (figures in docs/kv-connector.md, Codec). It holds the GIL while it
runs, so long spans are hashed in short pieces, and other threads (the engine's) get their turns in
between.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

import xxhash

_PIECE_BYTES = 4 << 20


class RunningChecksum:
    """XXH3-64 fed span by span, in order: equal to `spans_checksum` of all the spans it was fed, so
    each part of a payload can be hashed right after it is written, while it is still in cache."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def add(self, addr: int, nbytes: int) -> None:
        for start in range(0, nbytes, _PIECE_BYTES):
            length = min(_PIECE_BYTES, nbytes - start)
            self._state.update(memoryview((ctypes.c_ubyte * length).from_address(addr + start)))

    @property
    def value(self) -> int:
        return int(self._state.intdigest())


def spans_checksum(spans: Sequence[tuple[int, int]]) -> int:
    """XXH3-64 of the concatenation of (address, bytes) spans: any split gives the same value."""
    running = RunningChecksum()
    for addr, nbytes in spans:
        running.add(addr, nbytes)
    return running.value


def combine_checksums(*values: int) -> int:
    """One checksum of several, in order (e.g. of a payload's data and of its scales)."""
    return int(xxhash.xxh3_64_intdigest(struct.pack(f"<{len(values)}Q", *values)))
