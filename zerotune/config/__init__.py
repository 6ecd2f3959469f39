"""zerotune's config: DeepSpeed JSON schema as typed pydantic sections.

``load_config`` validates (keeping HF-style "auto" values), ``resolve_config`` solves the
batch triple and replaces "auto"s, ``assert_implemented`` rejects what the engine cannot
run yet, ``format_resolved`` renders the result with each value's provenance.
"""

from __future__ import annotations

from .batch import BatchSizes, solve_batch
from .errors import ConfigError, NotSupportedError, NotSupportedYetError
from .implemented import assert_implemented
from .loading import load_config
from .report import format_resolved
from .resolve import resolve_config, resolved
from .schema import UNSUPPORTED_BLOCKS, ZeroTuneConfig
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    LRScalingConfig,
    MonitorConfig,
    OptimizerConfig,
    ParallelWriteConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
    WandbConfig,
)
from .types import AUTO
from .zero_section import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CheckpointConfig",
    "ConfigError",
    "FP16Config",
    "LRScalingConfig",
    "MonitorConfig",
    "NotSupportedError",
    "NotSupportedYetError",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "UNSUPPORTED_BLOCKS",
    "WandbConfig",
    "ZeroConfig",
    "ZeroTuneConfig",
    "assert_implemented",
    "format_resolved",
    "load_config",
    "resolve_config",
    "resolved",
    "solve_batch",
]
