"""DeepSpeed's LR schedules (``deepspeed/runtime/lr_schedules.py``) by name, same formulas.

Each schedule is a pure function of DeepSpeed's counter ``last_batch_iteration``: it
starts at -1 (the constructor already writes the iteration -1 values into the
optimizer, so the first optimizer step uses them) and ``step()`` -- called once after
each optimizer step -- increments it and writes the new lr into *every* param group.
Because the lr depends only on the counter, resuming is exact: ``state_dict()`` holds the
counter plus any value the schedule read from the optimizer at construction (by resume
time the optimizer's lr has been overwritten by the schedule itself), and
``load_state_dict()`` re-applies the lr for the restored counter.

Where these knowingly differ from DeepSpeed, it is to turn its silent fallbacks into
errors (an unknown ``warmup_type`` is an error, not "log"), or to fix an edge it gets
wrong: WarmupCosineLR sets *every* group to 0 before the first step (DeepSpeed only the
first group) and holds ``cos_min_ratio`` after ``total_num_steps`` (DeepSpeed's cosine
rises again).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from zerotune.config.errors import ConfigError
from zerotune.optim.validation import int_at_least, number_at_least, per_param_group

WARMUP_TYPES = ("log", "linear")
PARAMS_PATH = "scheduler.params"


def warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at ``iteration`` (0 at iteration 0, 1 from ``warmup_num_steps`` on).

    "log" rises fast early: log(iteration + 1) / log(warmup_num_steps); "linear" is
    iteration / warmup_num_steps. ``warmup_num_steps`` is already at least 2 (DeepSpeed's
    floor, so log(warmup_num_steps) is never 0).
    """
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class StepSchedule:
    """Shared mechanics: the step counter, writing lrs (and betas) to groups, checkpoint state.

    Subclasses define ``lrs_at(iteration)`` (one lr per param group) and may define
    ``betas_at(iteration)``; ``_from_optimizer`` names attributes read from the optimizer
    at construction, which ``state_dict`` therefore carries.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = int_at_least(last_batch_iteration, -1, PARAMS_PATH, "last_batch_iteration")
        self._from_optimizer: tuple[str, ...] = ()
        self._last_lr: list[float] = []

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def betas_at(self, iteration: int) -> list[tuple[float, float]] | None:
        return None

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current iteration."""
        return self.lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer (set by the constructor, so never empty)."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance the counter (or jump to ``last_batch_iteration``) and apply its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        state = {"last_batch_iteration": self.last_batch_iteration}
        state.update({name: getattr(self, name) for name in self._from_optimizer})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        for name in self._from_optimizer:
            if name in state:
                setattr(self, name, list(state[name]))
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):  # tensor lrs (capturable optimizers) stay tensors
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        betas = self.betas_at(self.last_batch_iteration)
        if betas is not None:
            for group, group_betas in zip(self.optimizer.param_groups, betas):
                group["betas"] = group_betas
        self._last_lr = list(lrs)


class LRRangeTest(StepSchedule):
    """lr = min_lr * (1 + step_rate * interval), interval = (iteration + 1) / step_size (floored if staircase).

    Used to find the largest lr that still trains; ``lr_range_test_min_lr`` may be a list
    with one value per param group.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_param_group(lr_range_test_min_lr, self.optimizer, PARAMS_PATH, "lr_range_test_min_lr")
        self.step_size = int_at_least(lr_range_test_step_size, 1, PARAMS_PATH, "lr_range_test_step_size")
        self.step_rate = number_at_least(lr_range_test_step_rate, 0.0, PARAMS_PATH, "lr_range_test_step_rate")
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def lrs_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [min_lr * (1 + self.step_rate * interval) for min_lr in self.min_lrs]


class OneCycle(StepSchedule):
    """1Cycle: lr climbs min -> max over ``cycle_first_step_size`` steps, falls back over
    ``cycle_second_step_size``, then optionally decays as min_lr / (1 + decay_lr_rate * k / decay_step_size).

    With ``cycle_momentum`` (and an optimizer with ``betas``), beta1 moves inversely
    between ``cycle_max_mom`` and ``cycle_min_mom``. As in DeepSpeed, beta2 is set to 0.99
    while cycling, beta1 starts at ``cycle_min_mom`` before the first step, and the stair
    counts are accepted but do not shape the schedule.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_param_group(cycle_min_lr, self.optimizer, PARAMS_PATH, "cycle_min_lr")
        self.max_lrs = per_param_group(cycle_max_lr, self.optimizer, PARAMS_PATH, "cycle_max_lr")
        first = int_at_least(cycle_first_step_size, 1, PARAMS_PATH, "cycle_first_step_size")
        second = first
        if cycle_second_step_size is not None:
            second = int_at_least(cycle_second_step_size, 1, PARAMS_PATH, "cycle_second_step_size")
        self.total_size = float(first + second)
        self.step_ratio = first / self.total_size
        if cycle_first_stair_count or cycle_second_stair_count:
            warnings.warn(
                "scheduler.params.cycle_*_stair_count: accepted for DeepSpeed compatibility but, as in DeepSpeed, "
                "it does not change the OneCycle schedule",
                stacklevel=2,
            )
        self.decay_step_size = int_at_least(decay_step_size, 0, PARAMS_PATH, "decay_step_size")
        self.decay_lr_rate = number_at_least(decay_lr_rate, 0.0, PARAMS_PATH, "decay_lr_rate")
        self.decay_mom_rate = number_at_least(decay_mom_rate, 0.0, PARAMS_PATH, "decay_mom_rate")
        self.cycle_momentum = bool(cycle_momentum) and _has_betas(self.optimizer)
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(
                f"scheduler.params.cycle_momentum: disabled because {type(self.optimizer).__name__} has no 'betas' "
                "to cycle (as in DeepSpeed)",
                stacklevel=2,
            )
        self.min_mom = number_at_least(cycle_min_mom, 0.0, PARAMS_PATH, "cycle_min_mom")
        self.max_mom = number_at_least(cycle_max_mom, 0.0, PARAMS_PATH, "cycle_max_mom")
        self._apply()

    def _scale(self, iteration: int) -> float:
        """Position in the triangle: 0 at the ends, 1 at the peak (after ``cycle_first_step_size`` steps)."""
        progress = (iteration + 1) / self.total_size
        x = progress + 1.0 - math.floor(1 + progress)
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        decay_interval = (iteration - self.total_size + 1) / self.decay_step_size
        return [low / (1 + self.decay_lr_rate * decay_interval) for low in self.min_lrs]

    def betas_at(self, iteration: int) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if iteration < 0:
            beta1 = self.min_mom  # DeepSpeed's constructor value (its formula would give max_mom here)
        elif iteration < self.total_size:
            beta1 = self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        elif self.decay_step_size == 0 or self.decay_mom_rate == 0:
            beta1 = self.max_mom
        else:
            beta1 = self.max_mom * (1 + self.decay_mom_rate * (iteration - self.total_size + 1) / self.decay_step_size)
        return [(beta1, 0.99)] * len(self.optimizer.param_groups)


class WarmupLR(StepSchedule):
    """lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` ("log" or "linear"), then stays.

    Both lrs may be lists (one per group); a scalar applies to every group. Without
    ``warmup_max_lr`` the first group's lr is used for all groups, as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = float(self.optimizer.param_groups[0]["lr"])
            self._from_optimizer = ("max_lrs",)
        self.min_lrs = per_param_group(warmup_min_lr, self.optimizer, PARAMS_PATH, "warmup_min_lr")
        self.max_lrs = per_param_group(warmup_max_lr, self.optimizer, PARAMS_PATH, "warmup_max_lr")
        self.warmup_num_steps = max(2, int_at_least(warmup_num_steps, 0, PARAMS_PATH, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self._apply()

    def _gamma(self, iteration: int) -> float:
        return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    gamma = (total_num_steps - iteration) / (total_num_steps - warmup_num_steps), floored at 0."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int_at_least(total_num_steps, 1, PARAMS_PATH, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(
                f"{PARAMS_PATH}.total_num_steps ({total_num_steps}) is less than warmup_num_steps ({warmup_num_steps})",
                stacklevel=2,
            )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(StepSchedule):
    """Scales each group's own lr: ratio rises from ``warmup_min_ratio`` to 1 over the warmup,
    then follows a half cosine to ``cos_min_ratio``, reached at iteration ``total_num_steps - 1``.

    Unlike WarmupLR this keeps groups' relative lrs, because it multiplies the lr each
    group had when the schedule was built.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int_at_least(total_num_steps, 1, PARAMS_PATH, "total_num_steps")
        self.warmup_min_ratio = number_at_least(warmup_min_ratio, 0.0, PARAMS_PATH, "warmup_min_ratio")
        self.warmup_num_steps = max(2, int_at_least(warmup_num_steps, 0, PARAMS_PATH, "warmup_num_steps"))
        self.cos_min_ratio = number_at_least(cos_min_ratio, 0.0, PARAMS_PATH, "cos_min_ratio")
        self.warmup_type = _warmup_type(warmup_type)
        if self.total_num_steps <= self.warmup_num_steps:
            raise ConfigError(
                f"{PARAMS_PATH}.total_num_steps",
                f"must exceed warmup_num_steps ({self.warmup_num_steps}, at least 2) to leave room for the "
                f"cosine decay; got {total_num_steps}",
            )
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._from_optimizer = ("base_lrs",)
        self._apply()

    def lr_ratio_at(self, iteration: int) -> float:
        """The factor applied to every group's base lr at ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        decay_steps = self.total_num_steps - self.warmup_num_steps
        decay_done = min(iteration - self.warmup_num_steps + 1, decay_steps)  # hold the floor after the end
        cosine = (1 + math.cos(math.pi * decay_done / decay_steps)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio_at(iteration)
        return [base_lr * ratio for base_lr in self.base_lrs]


def _torch_optimizer(optimizer: Any) -> Any:
    """The object whose ``param_groups`` get the lrs: an optimizer, or a wrapper's ``.optimizer``."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch.optim.Optimizer")


def _has_betas(optimizer: Any) -> bool:
    defaults = getattr(optimizer, "defaults", None)
    if defaults is not None:
        return "betas" in defaults
    return all("betas" in group for group in optimizer.param_groups)


def _warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ConfigError(f"{PARAMS_PATH}.warmup_type", f"must be one of {', '.join(WARMUP_TYPES)}; got {value!r}")
    return value
