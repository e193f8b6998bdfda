"""Decode's own account of each recent transfer: whether its KV was loaded, how many blocks and bytes
came, in how long and over which transport, or why it failed.

The router asks for it by transfer id (end_route's record path) to prove that a request's KV was
moved rather than recomputed. Only the latest KEPT transfers are remembered; an older or never-seen
id reads as unknown.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Literal

# As many as the receiver remembers ended ids for (expectations._ENDED_KEPT).
KEPT = 1000

State = Literal["loaded", "failed", "pending", "unknown"]


@dataclass(frozen=True)
class Record:
    """One transfer on one decode rank; parts from several prefill ranks add up."""

    state: State = "pending"
    reason: str = ""
    blocks: int = 0
    kv_bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0


class TransferRecords:
    """Thread-safe, bounded: parts are added as they load, the outcome when the transfer ends."""

    def __init__(self, kept: int = KEPT) -> None:
        self._lock = threading.Lock()
        self._kept = kept
        self._records: OrderedDict[str, Record] = OrderedDict()

    def add_part(
        self, transfer_id: str, *, blocks: int, kv_bytes: int, wire_bytes: int, seconds: float
    ) -> None:
        with self._lock:
            now = self._records.get(transfer_id, Record())
            self._put_locked(
                transfer_id,
                replace(
                    now,
                    blocks=now.blocks + blocks,
                    kv_bytes=now.kv_bytes + kv_bytes,
                    wire_bytes=now.wire_bytes + wire_bytes,
                    seconds=max(now.seconds, seconds),  # parts run side by side
                ),
            )

    def end(self, transfer_id: str, reason: str) -> None:
        """The transfer's outcome on this rank: loaded ("") or failed (the reason)."""
        with self._lock:
            now = self._records.get(transfer_id, Record())
            state: State = "failed" if reason else "loaded"
            self._put_locked(transfer_id, replace(now, state=state, reason=reason))

    def get(self, transfer_id: str, *, expected: bool) -> Record:
        """What this rank knows of the id; `expected`: decode waits for it (pending if not ended)."""
        with self._lock:
            found = self._records.get(transfer_id)
        if found is not None and found.state != "pending":
            return found
        if expected or found is not None:
            return found or Record()
        return Record(state="unknown")

    def _put_locked(self, transfer_id: str, record: Record) -> None:
        self._records[transfer_id] = record
        self._records.move_to_end(transfer_id)
        while len(self._records) > self._kept:
            self._records.popitem(last=False)
