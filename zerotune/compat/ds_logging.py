"""``deepspeed.utils.logging``: DeepSpeed's logging helpers over zerotune's own logger.

Tools reach this module as an attribute (Lightning sets ``deepspeed.utils.logging.logger``'s level
from its own ``logging_level``), so ``deepspeed.utils.logging`` must be this module, not the standard
``logging`` that ``deepspeed.utils`` happens to import. ``logger`` *is* the "zerotune" logger: a level
set through DeepSpeed's name quiets or opens zerotune's own lines.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import torch.distributed as dist

from zerotune.monitor.logging import get_logger

logger = get_logger()

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}

__all__ = ["logger", "log_dist", "print_json_dist", "warning_once", "log_levels", "LoggerFactory",
           "get_log_level_from_string", "set_log_level_from_string", "get_current_level", "should_log_le",
           "print_configuration"]


class LoggerFactory:
    """DeepSpeed's logger maker: a named logger writing ``[time] [LEVEL] [file:line:function] message``."""

    @staticmethod
    def create_logger(name: str | None = None, level: int = logging.WARNING) -> logging.Logger:
        if name is None:
            raise ValueError("LoggerFactory.create_logger: name must be a logger name, got None")
        created = logging.getLogger(name)
        created.setLevel(level)
        created.propagate = False
        if not any(getattr(h, "_zerotune_factory", False) for h in created.handlers):
            handler = logging.StreamHandler()
            handler.setLevel(level)
            handler.setFormatter(logging.Formatter(
                "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
            handler._zerotune_factory = True  # type: ignore[attr-defined]
            created.addHandler(handler)
        return created


def _listed(ranks: list[int] | None) -> tuple[bool, int]:
    """Whether this rank is one of ``ranks`` (``[-1]``: all), and its rank (-1 before init).

    Once torch.distributed is initialized, no ``ranks`` means no rank (DeepSpeed's rule); before,
    the single process always is."""
    if not dist.is_initialized():
        return True, -1
    rank = dist.get_rank()
    if not ranks:
        return False, rank
    return ranks[0] == -1 or rank in set(ranks), rank


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` prefixed ``[Rank r]`` on the listed ranks."""
    listed, rank = _listed(ranks)
    if listed:
        logger.log(level, "[Rank %d] %s", rank, message)


def print_json_dist(message: dict[str, Any], ranks: list[int] | None = None, path: str | None = None) -> None:
    """Write ``message`` (plus this rank's number) as JSON to ``path`` on the listed ranks."""
    listed, rank = _listed(ranks)
    if not listed:
        return
    if path is None:
        raise ValueError("print_json_dist: path must name the JSON file to write, got None")
    message["rank"] = rank
    with open(path, "w") as out:
        json.dump(message, out)
        out.flush()
        os.fsync(out.fileno())


@functools.lru_cache(None)
def warning_once(*args: Any, **kwargs: Any) -> None:
    """``logger.warning`` that emits each distinct message once per process."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once  # type: ignore[attr-defined]


def print_configuration(args: Any, name: str) -> None:
    logger.info("%s:", name)
    for arg in sorted(vars(args)):
        logger.info("  %s %s %s", arg, "." * (29 - len(arg)), getattr(args, arg))


def get_log_level_from_string(log_level_str: str) -> int:
    level = log_levels.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {', '.join(log_levels)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when the logger's level is at or below ``max_log_level_str`` ("info": INFO or DEBUG)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"should_log_le: expected a level name such as 'info', got {max_log_level_str!r}")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)
