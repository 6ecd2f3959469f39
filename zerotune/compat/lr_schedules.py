"""``deepspeed.runtime.lr_schedules``: the schedule classes and DeepSpeed's name constants."""

from __future__ import annotations

import argparse

from zerotune.optim.scheduler_config import SCHEDULER_NAMES
from zerotune.optim.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = list(SCHEDULER_NAMES)
LR_SCHEDULE = "lr_schedule"

# The schedules' parameter names: each constant is the key it names (``params[WARMUP_NUM_STEPS]``).
_PARAMETER_NAMES = (
    "lr_range_test_min_lr", "lr_range_test_step_rate", "lr_range_test_step_size", "lr_range_test_staircase",
    "edge_value", "mid_value", "cycle_first_step_size", "cycle_first_stair_count", "cycle_second_step_size",
    "cycle_second_stair_count", "decay_step_size", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_min_mom",
    "cycle_max_mom", "decay_mom_rate", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
    "warmup_min_ratio", "cos_min_ratio", "total_num_steps")
globals().update({name.upper(): name for name in _PARAMETER_NAMES})
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"

__all__ = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR",
           "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "add_tuning_arguments",
           "LR_SCHEDULE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", *(name.upper() for name in _PARAMETER_NAMES)]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's convenience arguments for the LR schedules (``--lr_schedule`` and the schedule knobs)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument("--lr_schedule", type=str, default=None, help="LR schedule for training.")
    group.add_argument("--lr_range_test_min_lr", type=float, default=0.001)
    group.add_argument("--lr_range_test_step_rate", type=float, default=1.0)
    group.add_argument("--lr_range_test_step_size", type=int, default=1000)
    group.add_argument("--lr_range_test_staircase", type=bool, default=False)
    group.add_argument("--cycle_first_step_size", type=int, default=1000)
    group.add_argument("--cycle_first_stair_count", type=int, default=-1)
    group.add_argument("--cycle_second_step_size", type=int, default=-1)
    group.add_argument("--cycle_second_stair_count", type=int, default=-1)
    group.add_argument("--decay_step_size", type=int, default=1000)
    group.add_argument("--cycle_min_lr", type=float, default=0.01)
    group.add_argument("--cycle_max_lr", type=float, default=0.1)
    group.add_argument("--decay_lr_rate", type=float, default=0.0)
    group.add_argument("--cycle_min_mom", type=float, default=0.8)
    group.add_argument("--cycle_max_mom", type=float, default=0.9)
    group.add_argument("--decay_mom_rate", type=float, default=0.0)
    group.add_argument("--warmup_min_lr", type=float, default=0)
    group.add_argument("--warmup_max_lr", type=float, default=0.001)
    group.add_argument("--warmup_num_steps", type=int, default=1000)
    group.add_argument("--warmup_type", type=str, default="log")
    return parser
