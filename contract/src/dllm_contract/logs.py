"""One logging scheme for every entry point (dllm-operator, dllm-serve, dllm-router).

Loggers are named by module (`logging.getLogger(__name__)`), so a line says which package and module
wrote it; every process writes one format to stderr, where Kubernetes collects it; the level comes
from --log-level, else DLLM_LOG_LEVEL, else INFO, the same for every entry point (the router also
takes its own DLLM_ROUTER_LOG_LEVEL twin first), and is checked here, so a typo is refused at start.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LEVEL = "INFO"
LOG_LEVEL_FLAG = "--log-level"
ENV_LOG_LEVEL = "DLLM_LOG_LEVEL"
LEVEL_HELP = f"{' | '.join(LEVELS)}, in any case (default: {ENV_LOG_LEVEL}, else {DEFAULT_LEVEL})"
# Libraries whose INFO lines repeat what ours say, or one line per request.
QUIET = ("aiohttp.access", "kopf.objects")


def checked_level(value: str) -> str:
    """The level name in upper case; ValueError naming the allowed ones otherwise."""
    level = value.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"{value!r} is not one of {', '.join(LEVELS)} (any case)")
    return level


def chosen_level(flag: str | None, env: Mapping[str, str]) -> str:
    """The --log-level value, else DLLM_LOG_LEVEL, else INFO, checked; ValueError naming both."""
    try:
        return checked_level(flag or env.get(ENV_LOG_LEVEL) or DEFAULT_LEVEL)
    except ValueError as bad:
        raise ValueError(f"{LOG_LEVEL_FLAG} (or {ENV_LOG_LEVEL}): {bad}") from None


def configure_logging(level: str, handler: logging.Handler | None = None) -> None:
    """Root logger at `level`, one handler (stderr unless given) with LOG_FORMAT unless it has one."""
    chosen = handler or logging.StreamHandler(sys.stderr)
    if chosen.formatter is None:
        chosen.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=checked_level(level), handlers=[chosen], force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
