"""``deepspeed.runtime.zero.offload_config`` and ``deepspeed.runtime.zero.offload_states`` under the alias.

The enums scripts pass to ``engine.offload_states(include=[...], device=...)`` (RLHF loops move the policy's
optimizer state to the host while it generates), DeepSpeed's names of the two offload config sections, and
``get_state_devices``. The enums are ``str`` enums as in DeepSpeed, so each member equals its plain name: the
engine (``zerotune/engine_offload_states.py``) takes either, and zerotune's core never imports this module.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from zerotune.config.zero_section import OffloadOptimizerConfig, OffloadParamConfig

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "DeepSpeedZeroOffloadParamConfig",
           "DeepSpeedZeroOffloadOptimizerConfig", "get_state_devices"]


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state goes (``offload_states`` takes ``cpu``; ``none`` moves nothing)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of ZeRO state ``offload_states`` moves (``zerotune/zero/offloadable.py`` says what each holds)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
"""``zero_optimization.offload_param`` (DeepSpeed's class name; zerotune's typed section)."""
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
"""``zero_optimization.offload_optimizer`` (DeepSpeed's class name; zerotune's typed section)."""


def get_state_devices(model: Any, state: OffloadStateTypeEnum | str) -> set[torch.device]:
    """The devices ``state`` lives on in engine ``model`` now: the host while offloaded, none for freed scratch."""
    return model.state_devices(state)
