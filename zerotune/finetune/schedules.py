"""The learning-rate schedule of a recipe run, on the engine's DeepSpeed schedules (``zerotune/optim/schedulers.py``).

``train.lr_scheduler`` picks one of three shapes after a linear warm-up -- ``linear`` (WarmupDecayLR), ``cosine``
(WarmupCosineLR) or ``constant`` (WarmupLR) -- and an engine section's own ``scheduler`` gets the recipe's values
where it leaves them out or "auto". Both start the schedule at iteration 1 (``last_batch_iteration: 1``), so
optimizer step k trains with iteration k: the first step trains at the warm-up's first non-zero lr instead of at
lr 0 twice (DeepSpeed's schedules start at -1 and their warm-up at 0), and a decay filled from the recipe ends
after the last step, so no step trains at lr 0 unless the engine section asks for it.
"""

from __future__ import annotations

from typing import Any

from zerotune.config.pydantic_errors import show_value
from zerotune.finetune.recipe_checks import RecipeError
from zerotune.finetune.recipe_sections import TrainSection
from zerotune.optim.scheduler_config import SCHEDULER_NAMES

SCHEDULE_TYPES = {"linear": "WarmupDecayLR", "cosine": "WarmupCosineLR", "constant": "WarmupLR"}
# How many iterations after the last optimizer step a decay filled from the recipe ends: WarmupDecayLR reaches
# its floor (0) at iteration total_num_steps, WarmupCosineLR one iteration earlier (DeepSpeed's formulas).
END_AFTER_LAST_STEP = {"WarmupDecayLR": 1, "WarmupCosineLR": 2}
FIRST_ITERATION = 1  # optimizer step k trains with iteration k


def warmup_steps(train: TrainSection, total: int | None, at_load: bool) -> int:
    """``train.warmup_steps``, or ``train.warmup_ratio`` of the ``total`` optimizer steps."""
    if train.warmup_ratio is None:
        return train.warmup_steps
    if total is not None:
        return round(train.warmup_ratio * total)
    if at_load:
        return 0  # the trainer passes total_steps once it knows the data size
    raise RecipeError("train.warmup_ratio", "needs the total number of optimizer steps: set train.max_steps "
                                            "(or pass total_steps to recipe_engine_config)")


def first_iteration(warmup: int) -> int:
    """The schedule iteration the first optimizer step trains with: 1, or 2 past the warm-up DeepSpeed's schedules
    floor at 2 iterations when the recipe's warm-up is 0 or 1 step (so the first step trains at the peak)."""
    return FIRST_ITERATION if warmup > 1 else FIRST_ITERATION + 1


def recipe_schedule(train: TrainSection, lr: Any, total: int | None, at_load: bool) -> dict[str, Any]:
    """The engine ``scheduler`` block for ``train.lr_scheduler`` over ``total`` optimizer steps.

    Without a known ``total`` linear cannot decay (WarmupLR: the warm-up, then flat); cosine needs it, except at
    load time where the config is only validated.
    """
    warmup = warmup_steps(train, total, at_load)
    kind = train.lr_scheduler
    first = first_iteration(warmup)
    start = {"warmup_num_steps": max(warmup, 2), "warmup_type": "linear", "last_batch_iteration": first}
    if kind == "cosine" and total is not None:
        end = total + END_AFTER_LAST_STEP["WarmupCosineLR"] + first - 1
        if max(warmup, 2) >= end:
            key = "train.warmup_ratio" if train.warmup_ratio is not None else "train.warmup_steps"
            raise RecipeError(key, f"{warmup} warm-up steps leave no room for the cosine decay over {total} "
                                   "optimizer steps; lower it, or use train.lr_scheduler constant")
        return {"type": "WarmupCosineLR", "params": {"total_num_steps": end, "warmup_min_ratio": 0.0,
                                                     "cos_min_ratio": train.min_lr_ratio, **start}}
    if kind == "cosine" and not at_load:
        raise RecipeError("train.lr_scheduler", "cosine needs the total number of optimizer steps: set "
                                                "train.max_steps (or pass total_steps to recipe_engine_config)")
    if kind != "constant" and total is not None:
        end = total + END_AFTER_LAST_STEP["WarmupDecayLR"] + first - 1
        return {"type": "WarmupDecayLR", "params": {"total_num_steps": end, "warmup_min_lr": 0.0,
                                                    "warmup_max_lr": lr, **start}}
    return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0 if warmup > 1 else lr, "warmup_max_lr": lr, **start}}


def fill_engine_schedule(scheduler: dict[str, Any], train: TrainSection, lr: Any, total: int | None,
                         at_load: bool) -> None:
    """Put the recipe's values into the engine section's own ``scheduler`` where it leaves them to the recipe.

    "auto" values take the recipe's (warm-up steps, lr, total steps). DeepSpeed's warm-up schedules also get what
    they would otherwise take from DeepSpeed's defaults (1000 warm-up steps, WarmupDecayLR's lr 0.001) or miss
    (the total steps), and start at iteration 1 unless the section sets ``last_batch_iteration``; a total filled
    from the recipe ends the decay after the last step, and a warm-up of 0 or 1 step filled from the recipe starts
    past the warm-up, at the peak. A value the engine sets and the recipe sets differently
    is an error naming both.
    """
    if "lr_scheduler" in train.model_fields_set or "min_lr_ratio" in train.model_fields_set:
        key = "lr_scheduler" if "lr_scheduler" in train.model_fields_set else "min_lr_ratio"
        raise RecipeError(f"train.{key}", f"{getattr(train, key)!r} conflicts with engine.scheduler (type "
                                          f"{scheduler.get('type')!r}); set the schedule in one place")
    if scheduler.get("params") is None:
        scheduler["params"] = {}
    params: dict[str, Any] = scheduler["params"]
    sched_type = {name.lower(): name for name in SCHEDULER_NAMES}.get(str(scheduler.get("type")).lower())
    warm_up_family = sched_type in SCHEDULE_TYPES.values()
    prefix = "engine.scheduler.params"
    warmup = warmup_steps(train, total, at_load)
    # a warmup_ratio is a number of steps only once the total is known (at load it may not be)
    warmup_explicit = (train.warmup_ratio is not None and total is not None) or "warmup_steps" in train.model_fields_set
    recipe_warmup = warm_up_family and params.get("warmup_num_steps", "auto") == "auto"  # the recipe's to fill
    _fill(params, "warmup_num_steps", warmup, missing=warm_up_family, explicit=warmup_explicit,
          recipe_key="train.warmup_steps", engine_key=f"{prefix}.warmup_num_steps")
    _fill(params, "warmup_max_lr", lr, missing=sched_type == "WarmupDecayLR", explicit=False, recipe_key="train.lr",
          engine_key=f"{prefix}.warmup_max_lr")
    first = first_iteration(warmup) if recipe_warmup and "last_batch_iteration" not in params else FIRST_ITERATION
    if sched_type in END_AFTER_LAST_STEP or "total_num_steps" in params:
        _fill_total(params, sched_type, train, total, at_load, prefix, first)
    if recipe_warmup:
        params.setdefault("warmup_type", "linear")  # the recipe's warm-up is linear (DeepSpeed's default is log)
    if warm_up_family:
        params.setdefault("last_batch_iteration", first)


def left_to_recipe(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of an engine config in which what the recipe fills into its schedule (a missing total step count)
    reads "auto", to validate the engine section on its own before the recipe's values are known."""
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict) or not isinstance(scheduler.get("params", {}), dict):
        return config
    sched_type = {name.lower(): name for name in SCHEDULER_NAMES}.get(str(scheduler.get("type")).lower())
    if sched_type not in END_AFTER_LAST_STEP or "total_num_steps" in (scheduler.get("params") or {}):
        return config
    params = {**(scheduler.get("params") or {}), "total_num_steps": "auto"}
    return {**config, "scheduler": {**scheduler, "params": params}}


def _fill(params: dict[str, Any], key: str, value: Any, *, missing: bool, explicit: bool, recipe_key: str,
          engine_key: str) -> None:
    if params.get(key) == "auto" or (missing and key not in params):
        params[key] = value
    elif key in params and explicit and params[key] != value:
        raise _conflict(recipe_key, value, engine_key, params[key])


def _fill_total(params: dict[str, Any], sched_type: Any, train: TrainSection, total: int | None, at_load: bool,
                prefix: str, first: int) -> None:
    given = params.get("total_num_steps")
    if given is not None and given != "auto":
        if train.max_steps is not None and total is not None and given not in (
                total, total + END_AFTER_LAST_STEP.get(sched_type, 0)):
            raise _conflict("train.max_steps", total, f"{prefix}.total_num_steps", given)
        return
    if total is not None:
        params["total_num_steps"] = total + END_AFTER_LAST_STEP.get(sched_type, 0) + first - 1
    elif at_load:
        params["total_num_steps"] = "auto"  # validated as "auto" now; the trainer fills it with the step count
    else:
        raise RecipeError(f"{prefix}.total_num_steps", f"required by {sched_type} and unknown here: set it, or set "
                                                       "train.max_steps (or pass total_steps to recipe_engine_config)")


def _conflict(recipe_key: str, recipe_value: Any, engine_key: str, engine_value: Any) -> RecipeError:
    return RecipeError(recipe_key, f"{show_value(recipe_value)} conflicts with {engine_key} "
                                   f"{show_value(engine_value)}; set it in one place")
