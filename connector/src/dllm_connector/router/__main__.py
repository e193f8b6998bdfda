"""`dllm-router`: parse flags (and DLLM_ROUTER_* variables), then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from dllm_connector.router.config import ConfigError, RouterConfig, parse_config
from dllm_connector.router.server import Router, serve

log = logging.getLogger("dllm.router")
DRAIN_S = 25.0  # in-flight requests finish before SIGKILL (30 s after SIGTERM by default)


async def run(config: RouterConfig) -> None:
    router = Router(config)
    await router.start()
    runner = await serve(router, config.host, config.port, drain_s=DRAIN_S)
    log.info(
        "dllm-router on %s:%d, flow %s, prefill %s, decode %s",
        config.host,
        config.port,
        config.flow,
        config.prefill.dns or ",".join(config.prefill.urls),
        config.decode.dns or ",".join(config.decode.urls),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("stopping: no new connections; in-flight requests get up to %.0f s", DRAIN_S)
    finally:
        await runner.cleanup()
        await router.close()


def configure_logging(level: str) -> None:
    # One access line per request: skip the record fields the format never shows (logging's own advice).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None  # no caller lookup per record (the logging HOWTO's "Optimization")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, os.environ)
        if config.event_loop == "uvloop":
            import uvloop  # type: ignore[import-not-found, unused-ignore]  # optional: the standard loop works
    except ConfigError as e:
        print(f"dllm-router: {e}", file=sys.stderr)
        return 2
    except ImportError:
        message = "--event-loop (or DLLM_ROUTER_EVENT_LOOP): uvloop is not installed"
        print(f"dllm-router: {message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    if config.event_loop == "uvloop":
        uvloop.run(run(config))
    else:
        asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
