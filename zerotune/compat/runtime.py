"""``deepspeed.runtime`` (and its ``engine``, ``config``, ``utils``, ``dataloader`` modules)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist

from zerotune.compat import lr_schedules, pipe, runtime_utils, zero
from zerotune.compat.config_utils import get_scalar_param
from zerotune.compat.monitor import DeepSpeedMonitorConfig
from zerotune.compat.precision_config import get_bfloat16_config, get_float16_config
from zerotune.compat.runtime_constants import (
    GRADIENT_CLIPPING,
    GRADIENT_CLIPPING_DEFAULT,
    LOG_LEVEL,
    LOG_LEVEL_DEFAULT,
)
from zerotune.compat.runtime_utils import see_memory_usage
from zerotune.compat.utils import RepeatingLoader, set_random_seed
from zerotune.config import ConfigError as DeepSpeedConfigError
from zerotune.config import load_config, resolve_config
from zerotune.config.batch import solve_batch
from zerotune.config.errors import BatchSizeError
from zerotune.engine import Engine as DeepSpeedEngine
from zerotune.monitor.logging import get_logger

# DeepSpeed's optimizer type names (deepspeed/runtime/config.py), for the types zerotune builds: scripts compare
# ``config["optimizer"]["type"].lower()`` against them. The one-bit Lamb, 0/1 Adam, muP, Lion and Muon names are not
# here: zerotune refuses those types when a config names them (optim/optimizers.py).
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER]

__all__ = ["ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER",
           "ONEBIT_ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "DeepSpeedEngine", "DeepSpeedConfig",
           "DeepSpeedConfigError", "RepeatingLoader", "set_random_seed", "see_memory_usage", "zero", "pipe",
           "lr_schedules", "utils", "get_gradient_clipping", "get_log_level"]

# deepspeed.runtime.{engine, config, dataloader} are this module under the alias; runtime.utils has its own.
engine = config = dataloader = sys.modules[__name__]
utils = runtime_utils


def get_gradient_clipping(param_dict: dict[str, Any]) -> float:
    """The config dict's ``gradient_clipping``, else zerotune's default (0.0: DeepSpeed 0.18's; runtime_constants.py
    says why not 0.19's 1.0)."""
    return get_scalar_param(param_dict, GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


def get_log_level(param_dict: dict[str, Any]) -> str | None:
    """The config dict's ``log_level`` (None when absent: initialize leaves the logger's level alone)."""
    return get_scalar_param(param_dict, LOG_LEVEL, LOG_LEVEL_DEFAULT)


class DeepSpeedConfig:
    """A config file or dict read the way DeepSpeed's ``DeepSpeedConfig`` exposes it.

    The batch triple is solved for the data-parallel size of the current world (every rank data
    parallel unless ``mpu`` says otherwise), "auto" values take their defaults, and the usual
    attributes are set (``train_batch_size``, ``zero_optimization_stage``, ``fp16_enabled``, ...).
    ``config`` is the resolved zerotune config; ``_param_dict`` the resolved dict.
    """

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        dp = mpu.get_data_parallel_world_size() if mpu is not None else world
        resolved = resolve_config(load_config(config), dp_world_size=dp, strict=False)
        self.config = resolved
        self._param_dict = resolved.to_dict()
        self.world_size = dp
        self.train_batch_size = resolved.train_batch_size
        self.train_micro_batch_size_per_gpu = resolved.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = resolved.gradient_accumulation_steps
        self.steps_per_print = resolved.steps_per_print
        self.wall_clock_breakdown = resolved.wall_clock_breakdown
        self.gradient_clipping = resolved.gradient_clipping
        self.log_level = resolved.log_level
        self.float16_config = get_float16_config(self._param_dict)  # DeepSpeed's models of the two blocks
        self.bfloat16_config = get_bfloat16_config(self._param_dict)
        self.zero_config = resolved.zero_optimization
        self.zero_optimization_stage = resolved.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0 if isinstance(self.zero_optimization_stage, int) else True
        self.fp16_enabled = resolved.fp16.enabled is True
        self.bfloat16_enabled = resolved.bf16.enabled is True
        self.optimizer_name = resolved.optimizer.type.lower() if resolved.optimizer else None
        self.optimizer_params = dict(resolved.optimizer.params) if resolved.optimizer else None
        self.scheduler_name = resolved.scheduler.type if resolved.scheduler else None
        self.scheduler_params = dict(resolved.scheduler.params) if resolved.scheduler else None
        self.activation_checkpointing_config = resolved.activation_checkpointing
        self.monitor_config = DeepSpeedMonitorConfig(resolved.tensorboard, resolved.wandb, resolved.csv_monitor)
        self.checkpoint_tag_validation_enabled = resolved.checkpoint.tag_validation != "Ignore"
        self.checkpoint_tag_validation_fail = resolved.checkpoint.tag_validation == "Fail"

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's re-solve of the batch triple after a script assigned its attributes (None = not given): the
        missing members are filled for ``world_size``; a triple that does not fit, or one with neither
        ``train_batch_size`` nor the micro batch, is a BatchSizeError (an AssertionError, as DeepSpeed's asserts)."""
        try:
            tbs, micro, gas = (value if isinstance(value, int) else None for value in (  # "auto": not given
                self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps))
            sizes = solve_batch(tbs, micro, gas, self.world_size)
        except BatchSizeError:
            raise
        except DeepSpeedConfigError as exc:
            raise BatchSizeError(exc.path, exc.message) from None
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = sizes

    def print(self, name: str) -> None:
        get_logger().info("%s: %s", name, self._param_dict)
