"""`dllm-router`: parse flags (and DLLM_ROUTER_* variables), then serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TextIO

from dllm_contract import logs
from dllm_contract.logs import LOG_FORMAT
from dllm_router.accounting import access_log
from dllm_router.config import ConfigError, RouterConfig, parse_config
from dllm_router.server import Router, serve

log = logging.getLogger("dllm_router")  # this module runs as __main__
LOG_FLUSH_S = 0.1  # log lines written while serving reach stderr in one write per this interval


async def run(config: RouterConfig) -> None:
    router = Router(config)
    router.access_line = direct_access_line(access_log)
    await router.start()
    # --drain-seconds (M4): the operator derives it from the pod's terminationGracePeriodSeconds
    server = await serve(router, config.host, config.port, drain_s=config.drain_seconds)
    log.info(
        "dllm-router on %s:%d, flow %s, event loop %s, prefill %s, decode %s, engine API key %s",
        config.host,
        server.addresses[0][1],  # the bound port (--port 0 picks a free one)
        config.flow,
        type(asyncio.get_running_loop()).__module__.split(".")[0],
        config.prefill.dns or ",".join(config.prefill.urls),
        config.decode.dns or ",".join(config.decode.urls),
        "set" if config.engine_api_key else "not set",  # never the key itself
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("stopping: no new connections; in-flight requests get up to %g s", config.drain_seconds)
    finally:
        await server.cleanup()
        await router.close()
        for handler in logging.getLogger().handlers:
            handler.flush()  # the loop's timers end with it


class BatchedStreamHandler(logging.StreamHandler[TextIO]):
    """Lines logged on the event loop are joined and written once per LOG_FLUSH_S (one syscall for
    many access lines, instead of a write and flush per request); errors, and lines logged off the
    loop, are written at once. Logging's shutdown flushes what is left."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record) + self.terminator)
        except Exception:  # noqa: BLE001  # logging's own contract: handleError reports it
            self.handleError(record)
            return
        if record.levelno >= logging.ERROR:
            self.flush()
        else:
            self._flush_soon()

    def _flush_soon(self) -> None:
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(LOG_FLUSH_S, self.flush)

    def info_line(self, logger: str, message: str) -> None:
        """The line an INFO record of `logger` with this message would give, without making the record
        (the access line, once per request, skips logging's ~20 calls per record)."""
        formatter = self.formatter
        assert isinstance(formatter, _Formatter)
        self._lines.append(f"{formatter.stamp(time.time())} INFO {logger}: {message}{self.terminator}")
        self._flush_soon()

    def flush(self) -> None:
        self.acquire()
        try:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._lines:
                text = "".join(self._lines)
                self._lines.clear()
                self.stream.write(text)
            self.stream.flush()
        finally:
            self.release()


class _Formatter(logging.Formatter):
    """The standard format, with the date part of asctime made once per second, not per line."""

    _second = -1
    _prefix = ""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self.fmt = fmt  # what direct_access_line checks (logging keeps its own copy private)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self.stamp(record.created)

    def stamp(self, created: float) -> str:
        """asctime for a record created at `created` (as LogRecord computes its msecs)."""
        second = int(created)
        if second != self._second:
            when = self.converter(created)
            self._second, self._prefix = second, time.strftime("%Y-%m-%d %H:%M:%S", when)
        return f"{self._prefix},{int((created - second) * 1000):03d}"


def direct_access_line(logger: logging.Logger) -> Callable[[str], None] | None:
    """A writer for `logger`'s INFO lines straight into the handler, when that gives exactly what
    logging would (our handler alone on the root, no filters, nothing else on the way); else None."""
    root = logging.getLogger()
    handlers = root.handlers
    if len(handlers) != 1 or not isinstance(handlers[0], BatchedStreamHandler):
        return None
    handler = handlers[0]
    chain = [logger, *(p for p in _parents(logger))]
    if any(x.handlers for x in chain[:-1]) or not all(x.propagate for x in chain[:-1]):
        return None
    if any(x.filters for x in chain) or handler.filters or handler.level > logging.INFO:
        return None
    if not isinstance(handler.formatter, _Formatter) or handler.formatter.fmt != LOG_FORMAT:
        return None
    return partial(handler.info_line, logger.name)


def _parents(logger: logging.Logger) -> list[logging.Logger]:
    out = []
    parent = logger.parent
    while parent is not None:
        out.append(parent)
        parent = parent.parent
    return out


def configure_logging(level: str) -> None:
    """The one logging scheme (dllm_contract.logs), written through the batching handler."""
    # Skip the record fields the format never shows (the logging HOWTO's "Optimization"); the access
    # line, one per request, makes no record at all (direct_access_line).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = BatchedStreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(LOG_FORMAT))
    logs.configure_logging(level, handler)


def event_loop_runner(choice: str) -> Any:
    """`asyncio.run`, or `uvloop.run` for `uvloop` (and for `auto` when uvloop is installed)."""
    if choice == "asyncio" or (choice == "auto" and importlib.util.find_spec("uvloop") is None):
        return asyncio.run
    import uvloop  # type: ignore[import-not-found, unused-ignore]  # optional: the standard loop works

    return uvloop.run


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv, os.environ)
        runner = event_loop_runner(config.event_loop)
    except ConfigError as e:
        print(f"dllm-router: {e}", file=sys.stderr)
        return 2
    except ImportError:
        message = "--event-loop (or DLLM_ROUTER_EVENT_LOOP): uvloop is not installed"
        print(f"dllm-router: {message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    coroutine: Coroutine[Any, Any, None] = run(config)
    runner(coroutine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
