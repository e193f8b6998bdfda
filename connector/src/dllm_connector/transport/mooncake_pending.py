"""Mooncake writes begun with `batch_transfer_async_write` and waited for together, so several pieces
are on the wire at once (gpu-review item 12).

`get_batch_transfer_status` returns once every batch named landed, or once one failed or ran past
Mooncake's own timeout; either way it frees the batches, so nothing reads or writes their memory after
it returned (Mooncake's transfer_engine_py.cpp). A failed write is written once more synchronously
within the caller's deadline, as the synchronous path does (a peer or node that stood still past
Mooncake's bound, then resumed, takes the same bytes: writing them again to the same place is harmless).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from dllm_connector.transport.base import PendingWrite, TransferTimeout

_log = logging.getLogger(__name__)


class MooncakePendingWrite(PendingWrite):
    def __init__(
        self,
        engine: Any,
        batches: Sequence[int],
        rewrite: Callable[[float], None],
        deadline: float,
        session: str,
    ) -> None:
        """`rewrite(seconds_left)`: the whole write again, synchronously; `deadline`: monotonic."""
        self._engine, self._batches = engine, list(batches)
        self._rewrite, self._deadline, self._session = rewrite, deadline, session
        self._waited = False

    def wait(self) -> None:
        if self._waited:
            return
        self._waited = True
        status = self._engine.get_batch_transfer_status(self._batches) if self._batches else 0
        if status == 0:
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(
                f"Mooncake write to {self._session} failed (status {status}) at its deadline"
            )
        _log.warning("Mooncake batch write to %s failed (status %s); again", self._session, status)
        self._rewrite(left)
