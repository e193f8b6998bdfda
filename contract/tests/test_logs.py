"""The one logging scheme: module-named loggers, one format on stderr, a checked level."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import pytest

from dllm_contract.logs import LOG_FORMAT, checked_level, chosen_level, configure_logging


@pytest.fixture(autouse=True)
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_line_names_time_level_and_module() -> None:
    stream = io.StringIO()
    configure_logging("info", logging.StreamHandler(stream))
    logging.getLogger("dllm_operator.controller").info("reconciled %s", "ns/llm")
    logging.getLogger("dllm_operator.controller").debug("not shown at INFO")
    line = stream.getvalue()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" INFO dllm_operator\.controller: reconciled ns/llm\n", line), line


def test_chatty_libraries_stay_at_warning_unless_debugging_asks_for_less() -> None:
    configure_logging("DEBUG", logging.StreamHandler(io.StringIO()))
    assert logging.getLogger("aiohttp.access").getEffectiveLevel() == logging.WARNING
    configure_logging("error", logging.StreamHandler(io.StringIO()))
    assert logging.getLogger("aiohttp.access").getEffectiveLevel() == logging.ERROR


def test_a_handler_with_its_own_format_keeps_it() -> None:
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(message)s"))
    configure_logging("INFO", handler)
    assert handler.formatter is not None
    assert handler.formatter._fmt == "%(message)s"
    assert LOG_FORMAT != "%(message)s"


@pytest.mark.parametrize("bad", ["LOUD", "", "info2", "20"])
def test_an_unknown_level_is_refused_naming_the_allowed_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        checked_level(bad)


def test_the_flag_wins_then_the_variable_then_info() -> None:
    assert chosen_level("warning", {"DLLM_LOG_LEVEL": "debug"}) == "WARNING"
    assert chosen_level(None, {"DLLM_LOG_LEVEL": "debug"}) == "DEBUG"
    assert chosen_level("", {"DLLM_LOG_LEVEL": ""}) == "INFO"
    with pytest.raises(ValueError, match=r"^--log-level \(or DLLM_LOG_LEVEL\): 'loud' is not one of DEBUG"):
        chosen_level(None, {"DLLM_LOG_LEVEL": "loud"})
