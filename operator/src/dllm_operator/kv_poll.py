"""Reads the KV check page of each ready router pod, for KVTransferVerified (kv_transfer.py says what a
page means).

Every `kv_check_poll_seconds`, for each resource whose router runs the check: one GET of
`/dllm/kv-check` on each ready router pod's HTTP port, by pod IP (each router pod checks the pairs on
its own; the Service would answer from one of them). A resource whose pages changed is reconciled, so
its status follows; one whose pages did not is left alone, so polling alone never writes. Reads are
bounded in time and size and run a few at a time, whatever the number of resources.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from dllm_contract.kv_check import PAGE_PATH
from dllm_operator.kv_transfer import MAX_PAGE_BYTES, PageInvalid, RouterPage, parse_page
from dllm_operator.page_reads import poll_forever
from dllm_operator.pods import is_ready

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 3.0
PARALLEL_READS = 8

Page = RouterPage | str  # a page, or why it could not be read
RouterPod = tuple[str, str, int]  # name, IP, HTTP port


def router_pods(pods: Iterable[dict[str, Any]]) -> list[RouterPod]:
    """The ready, not terminating pods among `pods` with an IP and a port named http."""
    found: list[RouterPod] = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if not is_ready(pod) or not status.get("podIP"):
            continue
        port = next(
            (
                p.get("containerPort")
                for c in pod.get("spec", {}).get("containers", [])
                for p in c.get("ports", [])
                if p.get("name") == "http"
            ),
            None,
        )
        if isinstance(port, int):
            found.append((meta.get("name", ""), status["podIP"], port))
    return found


async def read_page(session: aiohttp.ClientSession, ip: str, port: int) -> Page:
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with session.get(f"http://{host}:{port}{PAGE_PATH}", allow_redirects=False) as answer:
            if answer.status != 200:
                return f"HTTP {answer.status}"
            raw = bytearray()
            async for chunk in answer.content.iter_any():
                raw += chunk
                if len(raw) > MAX_PAGE_BYTES:
                    break  # parse_page refuses it by its size: no more is read
            return parse_page(bytes(raw))
    except PageInvalid as invalid:
        return str(invalid)
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        return f"unreachable ({type(error).__name__})"


class KVPoller:
    """`targets()` names the resources to read (key -> its ready router pods); `changed(key, pages)`
    is told when a resource's pages differ from the last read."""

    def __init__(
        self,
        interval_s: float,
        targets: Callable[[], Mapping[Any, list[RouterPod]]],
        changed: Callable[[Any, dict[str, Page]], None],
    ) -> None:
        self._interval_s, self._targets, self._changed = interval_s, targets, changed
        self._last: dict[Any, dict[str, Page]] = {}

    async def run(self) -> None:
        await poll_forever(self._interval_s, self.poll, READ_TIMEOUT_S, PARALLEL_READS)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        targets = self._targets()
        self._last = {key: pages for key, pages in self._last.items() if key in targets}
        keys = list(targets)
        results = await asyncio.gather(*(self._read_all(session, targets[key]) for key in keys))
        for key, pages in zip(keys, results, strict=True):
            if pages != self._last.get(key):
                self._last[key] = pages
                self._changed(key, pages)

    @staticmethod
    async def _read_all(session: aiohttp.ClientSession, pods: list[RouterPod]) -> dict[str, Page]:
        pages = await asyncio.gather(*(read_page(session, ip, port) for _, ip, port in pods))
        return {name: page for (name, _, _), page in zip(pods, pages, strict=True)}
