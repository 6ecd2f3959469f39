"""``import deepspeed``: the top-level names of DeepSpeed, each one zerotune's own object.

``initialize`` is zerotune's, with DeepSpeed's process-wide side effects around it: the arguments a prior
``tp_model_init`` recorded (``_TP_MODEL_INIT_ARGS``, here because scripts reset it here) merged into the config
first (``tp_model_init.py``), then the AutoTP training flag and the engine's mesh kept for
``deepspeed.utils.groups`` (DeepSpeed's groups outlive the engine).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch

from zerotune.compat import accelerator, checkpointing, comm, groups, ops, pipe, runtime, utils, zero
from zerotune.compat.accelerator import get_accelerator
from zerotune.compat.alias import DEEPSPEED_VERSION
from zerotune.compat.arguments import add_config_arguments
from zerotune.compat.autotp_checkpoint_info import attach_universal_checkpoint_info
from zerotune.compat.lr_schedules import add_tuning_arguments
from zerotune.compat.refusals import refused_class
from zerotune.compat.runtime import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedEngine
from zerotune.compat.tp_layers import attach_param_hooks, set_autotp_mode
from zerotune.compat.tp_model_init import (
    TPModelInitArgs,
    check_tp_group,
    config_dict,
    merge_tp_model_init,
    record_tp_model_init,
)
from zerotune.distributed.env import DEFAULT_PORT, init_distributed
from zerotune.inference import InferenceConfig as DeepSpeedInferenceConfig
from zerotune.inference import InferenceEngine, init_inference
from zerotune.initialize import initialize as zerotune_initialize
from zerotune.pipe.engine import PipelineEngine
from zerotune.zero.on_device import OnDevice

__version__ = DEEPSPEED_VERSION
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in DEEPSPEED_VERSION.split("+")[0].split("."))
__git_hash__ = "zerotune"
__git_branch__ = "zerotune"

DeepSpeedTransformerLayer = refused_class("deepspeed.DeepSpeedTransformerLayer")
DeepSpeedTransformerConfig = refused_class("deepspeed.DeepSpeedTransformerConfig")

_TP_MODEL_INIT_ARGS: TPModelInitArgs | None = None
"""What ``tp_model_init`` recorded, merged into the next ``initialize``'s config (scripts reset it to None)."""


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """DeepSpeed's ``tp_model_init``: record ``tp_size`` / ``dtype`` / ``tp_group`` for ``initialize`` (which
    splits the model) and switch AutoTP to training mode; returns ``model`` unchanged."""
    global _TP_MODEL_INIT_ARGS
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword argument(s) {sorted(unknown)}")
    _TP_MODEL_INIT_ARGS = record_tp_model_init(_TP_MODEL_INIT_ARGS, tp_size, dtype, kwargs.get("tp_group"))
    set_autotp_mode(training=True)
    return model


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = DEFAULT_PORT, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize``: zerotune's ``initialize`` with the ``tp_model_init`` record merged into the
    config; afterwards the AutoTP training flag is set (tensor_parallel.autotp_size > 0) and
    ``deepspeed.utils.groups`` answers from this engine's mesh."""
    recorded = _TP_MODEL_INIT_ARGS
    if recorded is not None:
        source = config if config is not None else config_params
        if source is None and args is not None:
            source, args = getattr(args, "deepspeed_config", None), None
        config, config_params = merge_tp_model_init(recorded, config_dict(source), mpu), None
    result = zerotune_initialize(args, model, optimizer, model_parameters, training_data, lr_scheduler,
                                 distributed_port, mpu, dist_init_required, collate_fn, config, mesh_param,
                                 config_params)
    engine = result[0]
    check_tp_group(recorded, engine.mesh.group("tp"))
    if int(engine.autotp_size()) > 0:
        set_autotp_mode(training=True)
    if engine.mesh.size("tp") > 1:  # DeepSpeed's schema of the split, read off zerotune's layouts
        attach_universal_checkpoint_info(engine.module)
    groups.adopt_engine_mesh(engine.mesh)
    attach_param_hooks(engine.module)  # (DeepSpeed's layers carry param.gather_params; the engine built zerotune's)
    return result


functools.update_wrapper(initialize, zerotune_initialize, assigned=(), updated=())  # __wrapped__: zerotune's


__all__ = [
    "initialize", "tp_model_init", "init_distributed", "add_config_arguments", "add_tuning_arguments",
    "DeepSpeedEngine",
    "PipelineEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "zero", "comm", "checkpointing", "pipe", "ops",
    "accelerator", "utils",
    "runtime", "get_accelerator", "init_inference", "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig",
    "InferenceEngine", "DeepSpeedInferenceConfig", "OnDevice",
]
