"""The linear LR scaling rule: scale the lr with the global batch size.

Goyal et al. (2017): when the batch grows k-fold, multiplying the lr by k keeps the
expected update per sample the same, so a recipe tuned at ``base_batch_size`` carries
over to more data-parallel ranks. Apply it to the optimizer *before* building a schedule
that reads the optimizer's lr (WarmupCosineLR, WarmupLR without ``warmup_max_lr``);
schedules given absolute lrs in their params (``warmup_max_lr``, ``cycle_max_lr``) need
those params scaled by the returned factor too.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotune.config.errors import ConfigError

LR_SCALING_RULES = ("linear",)


def scale_lr_linear(base_lr: float, train_batch_size: int, base_batch_size: int) -> float:
    """``base_lr * train_batch_size / base_batch_size``."""
    return base_lr * _linear_factor(train_batch_size, base_batch_size)


def apply_lr_scaling(optimizer: Any, rule: str, train_batch_size: int, base_batch_size: int) -> float:
    """Multiply every param group's ``lr`` (and ``initial_lr``, if a torch scheduler set one) by the rule's factor.

    Returns the factor, so the caller can scale absolute lrs in schedule params alike.
    """
    if rule not in LR_SCALING_RULES:
        raise ConfigError("lr_scaling.rule", f"unknown rule {rule!r}; valid rules: {', '.join(LR_SCALING_RULES)}")
    factor = _linear_factor(train_batch_size, base_batch_size)
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key not in group:
                continue
            if isinstance(group[key], torch.Tensor):
                group[key].mul_(factor)
            else:
                group[key] = group[key] * factor
    return factor


def _linear_factor(train_batch_size: int, base_batch_size: int) -> float:
    for key, value in (("train_batch_size", train_batch_size), ("base_batch_size", base_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"lr_scaling.{key}", f"must be a positive integer, got {value!r}")
    return train_batch_size / base_batch_size


SCHEDULE_LR_KEYS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr")


def scale_schedule_lrs(params: dict[str, Any], factor: float) -> dict[str, Any]:
    """A copy of scheduler params with the absolute lrs (``SCHEDULE_LR_KEYS``) multiplied by ``factor``."""
    scaled = dict(params)
    for key in SCHEDULE_LR_KEYS:
        value = scaled.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scaled[key] = value * factor
        elif isinstance(value, (list, tuple)):
            scaled[key] = [v * factor for v in value]
    return scaled
