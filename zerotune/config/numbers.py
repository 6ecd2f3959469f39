"""Range and finiteness of the optimizer's and scheduler's free-form numbers.

The ``optimizer.params`` and ``scheduler.params`` dicts are passed to constructors as keyword
arguments, and torch checks little: ``lr: Infinity`` builds an Adam whose first step makes every
weight NaN. Each number here (lists too: ``betas``) must be finite, and the well-known keys must be
in their meaningful range; a violation is one ConfigError naming the key. "auto" is left alone
(resolved later). The typed sections' numbers are checked by their field types (``types.py``).
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ConfigError

_OPTIMIZER_RANGES = {  # key -> (lowest, highest, whether the highest is allowed)
    "lr": (0.0, math.inf, False), "eps": (0.0, math.inf, False), "weight_decay": (0.0, math.inf, False),
    "momentum": (0.0, math.inf, False), "dampening": (0.0, math.inf, False),
    "initial_accumulator_value": (0.0, math.inf, False), "lr_decay": (0.0, math.inf, False),
    "betas": (0.0, 1.0, False), "max_coeff": (0.0, math.inf, False), "min_coeff": (0.0, math.inf, False),
}


def _numbers(value: Any, path: str) -> list[tuple[str, float]]:
    """Every number in ``value`` (a number, or a list / tuple of them) with its path."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(path, value)]
    if isinstance(value, (list, tuple)):
        return [item for index, element in enumerate(value) for item in _numbers(element, f"{path}[{index}]")]
    return []


def _check(params: dict[str, Any], section: str, range_of) -> None:
    for key, value in params.items():
        for path, number in _numbers(value, f"{section}.{key}"):
            if not math.isfinite(number):
                raise ConfigError(path, f"must be a finite number, got {number}")
            low, high, high_allowed = range_of(key)
            if number < low or number > high or (number == high and not high_allowed):
                bound = f"< {high}" if not high_allowed else f"<= {high}"
                rest = "" if high == math.inf else f" and {bound}"
                raise ConfigError(path, f"must be >= {low:g}{rest}, got {number:g}")


def _scheduler_range(key: str) -> tuple[float, float, bool]:
    """Learning rates, step counts, ratios and momenta of DeepSpeed's schedules are never negative."""
    if key.endswith("_lr") or key.endswith("_steps") or key.endswith("_size") or key.endswith("_ratio") \
            or key.endswith("_rate") or key.endswith("_mom") or key in ("last_batch_iteration",):
        return (-1.0, math.inf, False) if key == "last_batch_iteration" else (0.0, math.inf, False)
    return (-math.inf, math.inf, False)


def check_hyperparameters(cfg: Any) -> None:
    """Raise ConfigError on an unknown schedule, a missing or unknown schedule argument, or the first non-finite
    or out-of-range optimizer / scheduler number."""
    if cfg.optimizer is not None:
        from zerotune.optim.optimizers import check_optimizer_section

        check_optimizer_section(cfg.optimizer.type, cfg.optimizer.params)
        _check(cfg.optimizer.params, "optimizer.params",
               lambda key: _OPTIMIZER_RANGES.get(key, (-math.inf, math.inf, False)))
    if cfg.scheduler is not None:
        from zerotune.optim.scheduler_config import (
            check_scheduler_section,  # the builders' own rule; optim imports config
        )

        check_scheduler_section(cfg.scheduler.type, cfg.scheduler.params)
        _check(cfg.scheduler.params, "scheduler.params", _scheduler_range)
