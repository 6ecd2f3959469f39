"""The ``scheduler`` config section: a DeepSpeed LR schedule by its name, its params checked.

The schedules themselves (same formulas as DeepSpeed's) are in ``schedulers.py``; this is the lookup by
name that ``initialize`` and config validation (``zerotune check``) share.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from zerotune.config.errors import ConfigError
from zerotune.optim.schedulers import (
    PARAMS_PATH,
    LRRangeTest,
    OneCycle,
    StepSchedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)
from zerotune.optim.validation import check_known_keys, did_you_mean, reject_auto_values

_SCHEDULES: dict[str, type[StepSchedule]] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
SCHEDULER_NAMES: tuple[str, ...] = tuple(_SCHEDULES)


def build_scheduler(sched_type: str, params: Mapping[str, Any], optimizer: Any) -> StepSchedule:
    """Build DeepSpeed's ``{"type": sched_type, "params": params}`` schedule on ``optimizer``.

    The type name is case-insensitive. Raises ``ConfigError`` naming
    ``scheduler.type`` or ``scheduler.params.<key>`` for unknown, missing or bad values.
    """
    schedule_class = check_scheduler_section(sched_type, params)
    reject_auto_values(dict(params or {}), PARAMS_PATH)
    return schedule_class(optimizer, **dict(params or {}))


def check_scheduler_section(sched_type: Any, params: Mapping[str, Any] | None) -> type:
    """The schedule class ``sched_type`` names, once its ``params`` keys are known and none it requires is
    missing; a ConfigError naming ``scheduler.type`` or ``scheduler.params.<key>`` otherwise. Config
    validation calls this too, so ``zerotune check`` and ``initialize`` report it before any model is built
    ("auto" values are left to be resolved)."""
    by_lower = {name.lower(): name for name in SCHEDULER_NAMES}
    if not isinstance(sched_type, str) or sched_type.lower() not in by_lower:
        hint = did_you_mean(sched_type, SCHEDULER_NAMES) if isinstance(sched_type, str) else ""
        raise ConfigError(
            "scheduler.type", f"unknown scheduler {sched_type!r}.{hint} Valid types: {', '.join(SCHEDULER_NAMES)}"
        )
    schedule_class = _SCHEDULES[by_lower[sched_type.lower()]]
    params = dict(params or {})
    signature = {
        name: parameter
        for name, parameter in inspect.signature(schedule_class.__init__).parameters.items()
        if name not in ("self", "optimizer")
    }
    check_known_keys(params, signature, PARAMS_PATH)
    missing = [name for name, parameter in signature.items()
               if parameter.default is inspect.Parameter.empty and name not in params]
    if missing:
        wanted = ", ".join(f"{PARAMS_PATH}.{name} ({_MEANING.get(name, 'see the schedule')})" for name in missing)
        raise ConfigError(f"{PARAMS_PATH}.{missing[0]}", f"required by {schedule_class.__name__} but missing; set "
                                                         f"{wanted}")
    return schedule_class


# What a schedule's required params mean, for the error that names a missing one.
_MEANING = {"total_num_steps": "the number of optimizer steps the schedule spans, e.g. the run's total steps"}
