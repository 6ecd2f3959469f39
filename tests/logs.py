"""Logger isolation for tests: what a test attaches to a logger, it takes off again.

The "zerotune" logger does not propagate, so tests attach handlers to it directly. A handler
left behind leaks into every later test in the same process (the main pytest process, or a
persistent pool worker), which makes tests depend on their order: pytest's ``caplog.handler``
is a *different object* in setup, call and teardown, so a fixture that adds it in setup and
removes it in teardown removes nothing. These helpers snapshot and restore instead.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

ZEROTUNE_LOGGER = "zerotune"


@contextlib.contextmanager
def logger_state_restored(name: str = ZEROTUNE_LOGGER) -> Iterator[logging.Logger]:
    """Restore the logger's handlers, level, propagation and zerotune's set-up mark on exit."""
    logger = logging.getLogger(name)
    handlers, level, propagate, disabled = list(logger.handlers), logger.level, logger.propagate, logger.disabled
    marked = "_zerotune_configured" in vars(logger)
    mark = vars(logger).get("_zerotune_configured")
    try:
        yield logger
    finally:
        # Drop what the block added; put back what it removed -- except pytest's own capture handlers
        # (pytest >= 9.2 attaches them to non-propagating loggers for each phase and removes them itself;
        # restoring one from an earlier phase would leak it).
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)
        for handler in handlers:
            if handler not in logger.handlers and not type(handler).__module__.startswith("_pytest"):
                logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
        if marked:
            logger._zerotune_configured = mark  # type: ignore[attr-defined]
        else:
            vars(logger).pop("_zerotune_configured", None)


@contextlib.contextmanager
def recorded_messages(name: str = ZEROTUNE_LOGGER, level: int = logging.INFO) -> Iterator[list[str]]:
    """Collect the formatted messages logged to ``name`` inside the block (nothing stays attached)."""
    messages: list[str] = []

    class _Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    with logger_state_restored(name) as logger:
        logger.addHandler(_Recorder(level))
        if logger.getEffectiveLevel() > level:
            logger.setLevel(level)
        yield messages
