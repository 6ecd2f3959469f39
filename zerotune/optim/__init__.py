"""Optimizers and LR schedules by their DeepSpeed config names, and the LR scaling rule."""

from __future__ import annotations

from zerotune.optim.lamb import Lamb
from zerotune.optim.lr_scaling import LR_SCALING_RULES, apply_lr_scaling, scale_lr_linear, scale_schedule_lrs
from zerotune.optim.optimizers import OPTIMIZER_NAMES, build_optimizer, canonical_optimizer_name, optimizer_defaults
from zerotune.optim.scheduler_config import SCHEDULER_NAMES, build_scheduler
from zerotune.optim.schedulers import (
    WARMUP_TYPES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    warmup_fraction,
)

__all__ = [
    "LR_SCALING_RULES",
    "OPTIMIZER_NAMES",
    "SCHEDULER_NAMES",
    "WARMUP_TYPES",
    "LRRangeTest",
    "Lamb",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "apply_lr_scaling",
    "build_optimizer",
    "build_scheduler",
    "canonical_optimizer_name",
    "optimizer_defaults",
    "scale_lr_linear",
    "scale_schedule_lrs",
    "warmup_fraction",
]
