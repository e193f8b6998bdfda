"""Both roles' pods kept current: discovered from their sources, probed for health, in the background.

A new pod gets its keep-alive connection pool (`upstream/`) and joins once its first health check
passes; a gone pod's pool is closed (its in-flight requests finish on the connections they hold). The
health checks, the mooncake bootstrap /query and /v1/models use one aiohttp session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from dllm_contract import kv_fingerprint
from dllm_router import flows
from dllm_router.config import RouterConfig
from dllm_router.endpoints import AddressSource, Endpoint, Pool, scheme_of, source_for
from dllm_router.upstream import UpstreamPool

log = logging.getLogger(__name__)


class PodWatch:
    def __init__(
        self,
        config: RouterConfig,
        probe_headers: dict[str, str],
        *,
        prefill_source: AddressSource | None = None,
        decode_source: AddressSource | None = None,
    ) -> None:
        self.config = config
        self.prefill = Pool("prefill", scheme_of(config.prefill))
        self.decode = Pool("decode", scheme_of(config.decode))
        self._sources = {
            "prefill": prefill_source or source_for(config.prefill),
            "decode": decode_source or source_for(config.decode),
        }
        self.probe_headers = probe_headers  # the engines' key, when one is configured
        self.probe_timeout = aiohttp.ClientTimeout(total=config.connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loops: list[asyncio.Task[None]] = []

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() was not called"
        return self._session

    async def start(self, *, background: bool = True) -> None:
        """Discover and probe pods once, then keep doing so in the background."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        await self.refresh()
        if background:
            self._loops = [
                asyncio.create_task(self._every(self.config.resolve_interval_s, self.discover)),
                asyncio.create_task(self._every(self.config.health_interval_s, self.check_health)),
            ]

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        for pool in (self.prefill, self.decode):
            for ep in pool.endpoints.values():
                if ep.upstream is not None:
                    ep.upstream.close()

    @staticmethod
    async def _every(seconds: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await job()
            except Exception:
                log.exception("background %s failed", getattr(job, "__name__", job))

    async def refresh(self) -> None:
        await self.discover()
        await self.check_health()

    async def discover(self) -> None:
        """Re-read both sources; new pods are probed at once and join when healthy."""
        new: list[Endpoint] = []
        for pool in (self.prefill, self.decode):
            added, removed = pool.update(await self._sources[pool.role]())
            for ep in added:
                log.info("%s pod %s discovered", pool.role, ep.name)
                ep.upstream = UpstreamPool(
                    ep.host, ep.port, self.config.connect_timeout_s, ep.scheme == "https"
                )
            for ep in removed:
                log.info("%s pod %s gone (%d requests still in flight)", pool.role, ep.name, ep.inflight)
                if ep.upstream is not None:
                    ep.upstream.close()
            new += added
        await asyncio.gather(*(self._probe(ep) for ep in new))

    async def check_health(self) -> None:
        pods = [*self.prefill.endpoints.values(), *self.decode.endpoints.values()]
        await asyncio.gather(*(self._probe(ep) for ep in pods))

    async def _probe(self, ep: Endpoint) -> None:
        healthy, why, timed_out = await self._is_healthy(ep)
        if ep.healthy and timed_out:
            ep.slow_probes += 1
            if ep.slow_probes < self.config.health_timeouts:
                log.info("%s pod %s: health check %d of %d timed out; kept in", ep.role, ep.name,
                         ep.slow_probes, self.config.health_timeouts)  # fmt: skip
                return
        ep.slow_probes = 0
        if healthy != ep.healthy:
            if healthy:
                log.info("%s pod %s is ready", ep.role, ep.name)
            else:
                log.warning("%s pod %s taken out: %s", ep.role, ep.name, why)
        ep.healthy = healthy

    async def _is_healthy(self, ep: Endpoint) -> tuple[bool, str, bool]:
        """(healthy, why not, whether it timed out)."""
        try:
            timeout, headers = self.probe_timeout, self.probe_headers
            async with self.session.get(ep.url + "/health", timeout=timeout, headers=headers) as r:
                if r.status != 200:
                    return False, f"/health answered {r.status}", False
                ep.fingerprint = kv_fingerprint.valid(r.headers.get(kv_fingerprint.HEADER))
            if ep.role == "prefill" and self.config.flow == "mooncake":
                url = flows.bootstrap_url(ep.host, self.config.mooncake_bootstrap_port) + "/query"
                async with self.session.get(url, timeout=self.probe_timeout) as r:
                    r.raise_for_status()
                    ep.engine_ids = flows.parse_bootstrap_query(await r.json(content_type=None))
        except TimeoutError as e:
            return False, repr(e), True
        except (aiohttp.ClientError, ValueError) as e:
            return False, repr(e), False
        return True, "", False
