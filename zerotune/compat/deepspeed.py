"""``import deepspeed``: the top-level names of DeepSpeed, each one zerotune's own object."""

from __future__ import annotations

from zerotune.compat import accelerator, checkpointing, comm, ops, pipe, runtime, utils, zero
from zerotune.compat.accelerator import get_accelerator
from zerotune.compat.alias import DEEPSPEED_VERSION
from zerotune.compat.arguments import add_config_arguments
from zerotune.compat.lr_schedules import add_tuning_arguments
from zerotune.compat.refusals import refused_class
from zerotune.compat.runtime import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedEngine
from zerotune.distributed.env import init_distributed
from zerotune.inference import InferenceConfig as DeepSpeedInferenceConfig
from zerotune.inference import InferenceEngine, init_inference
from zerotune.initialize import initialize
from zerotune.pipe.engine import PipelineEngine
from zerotune.zero.on_device import OnDevice

__version__ = DEEPSPEED_VERSION
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in DEEPSPEED_VERSION.split("+")[0].split("."))
__git_hash__ = "zerotune"
__git_branch__ = "zerotune"

DeepSpeedTransformerLayer = refused_class("deepspeed.DeepSpeedTransformerLayer")
DeepSpeedTransformerConfig = refused_class("deepspeed.DeepSpeedTransformerConfig")

__all__ = [
    "initialize", "init_distributed", "add_config_arguments", "add_tuning_arguments", "DeepSpeedEngine",
    "PipelineEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "zero", "comm", "checkpointing", "pipe", "ops",
    "accelerator", "utils",
    "runtime", "get_accelerator", "init_inference", "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig",
    "InferenceEngine", "DeepSpeedInferenceConfig", "OnDevice",
]
