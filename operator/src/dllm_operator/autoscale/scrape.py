"""The autoscaler's reads of engine and router metrics pages over the pod network (issue 36).

A page is read by pod IP from the pod's HTTP port (`/metrics`: open on engines and routers, as the
kubelet's probes are), bounded in time by the caller's session and in size here; what comes back is
hostile until `signals.read_page` has checked it. `ScrapeMemory` keeps each pod's last page, so each
new scrape pairs with the one before it (the differences the signals need).
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from dllm_operator.autoscale.signals import Page, read_page

METRICS_PATH = "/metrics"
# vLLM's page is tens of KB; a page past this is not read at all.
MAX_METRICS_BYTES = 4 * 2**20


async def read_metrics(session: aiohttp.ClientSession, ip: str, port: int) -> Page | None:
    """The pod's page, or None: unreachable, not 200, too large, not UTF-8, or not a page."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with session.get(f"http://{host}:{port}{METRICS_PATH}", allow_redirects=False) as answer:
            if answer.status != 200:
                return None
            raw = bytearray()
            async for chunk in answer.content.iter_any():
                raw += chunk
                if len(raw) > MAX_METRICS_BYTES:
                    return None
        return read_page(raw.decode())
    except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
        return None


class ScrapeMemory:
    """Each pod's last page, by (resource, pod name): a pod that went is forgotten at the next scrape."""

    def __init__(self) -> None:
        self._last: dict[tuple[object, str], Page | None] = {}

    def pair(self, key: object, pages: Mapping[str, Page | None]) -> list[tuple[Page | None, Page | None]]:
        """(the page before, this page) for each pod read now for resource `key`; remembers these."""
        pairs = [(self._last.get((key, name)), page) for name, page in sorted(pages.items())]
        self._last = {k: v for k, v in self._last.items() if k[0] != key}
        self._last.update({(key, name): page for name, page in pages.items()})
        return pairs

    def forget(self, keep: set[object]) -> None:
        """Drop the pages of resources not in `keep` (deleted, or no longer autoscaled)."""
        self._last = {k: v for k, v in self._last.items() if k[0] in keep}
