"""``deepspeed.runtime.zero.config``: DeepSpeed's names for the ``zero_optimization`` section.

``DeepSpeedZeroConfig(**fields)`` builds zerotune's own typed section through the config loader, so
DeepSpeed's legacy and alias keys (``cpu_offload``, ``stage3_prefetch_bucket_size``, ...) are read the way
a config file's are, and an unknown key is the same one-line error."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from zerotune.config.loading import load_config
from zerotune.config.zero_section import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "ZeroStageEnum"]

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class ZeroStageEnum(IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def DeepSpeedZeroConfig(**fields: Any) -> ZeroConfig:  # noqa: N802 - DeepSpeed's class name, called the same way
    """The ``zero_optimization`` section holding ``fields``, validated as in a config file."""
    return load_config({"zero_optimization": fields}).zero_optimization
