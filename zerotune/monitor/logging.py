"""The "zerotune" logger and a rank-0 helper.

Every rank runs the same code, so an unguarded ``logger.info`` prints N copies of each
line; ``log_rank0`` keeps the console readable by letting only rank 0 speak.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "zerotune"
_FORMAT = "[zerotune] %(asctime)s %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


CONSOLE_HANDLER = "zerotune-console"


def get_logger() -> logging.Logger:
    """Return the "zerotune" logger, installing its console handler on first use.

    The handler is installed once (marked by an attribute) so repeated calls and
    re-imports never duplicate lines. ``propagate`` is off, as in DeepSpeed and
    transformers, so an application that configures the root logger does not print
    every line twice; tests that use ``caplog`` attach ``caplog.handler`` to this logger.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if not getattr(logger, "_zerotune_configured", False):
        handler = logging.StreamHandler(sys.stdout)
        handler.set_name(CONSOLE_HANDLER)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger._zerotune_configured = True  # type: ignore[attr-defined]
    return logger


def log_rank0(msg: str, *args: object, rank: int, level: int = logging.INFO) -> None:
    """Log ``msg % args`` (INFO by default), but only on rank 0 (formatting is skipped elsewhere)."""
    if rank == 0:
        get_logger().log(level, msg, *args, stacklevel=2)


def set_level(name: str) -> None:
    """Set the "zerotune" logger and its handlers to the level ``name`` ("error", "INFO", ...): what a config's
    ``log_level`` asks ``initialize`` for (DeepSpeed's logger is this one under the alias)."""
    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}
    level = levels.get(name.lower())
    if level is None:
        raise ValueError(f"log_level: {name!r} is not a level name; valid: {', '.join(levels)} (any case)")
    logger = get_logger()
    logger.setLevel(level)
    for handler in logger.handlers:
        handler.setLevel(level)
