"""``zero_optimization``: the ZeRO block, with DeepSpeed's key names and defaults.

Bucket sizes and thresholds count *elements*, not bytes, as in DeepSpeed. The stage-3
keys keep their ``stage3_`` prefix because that is what users write in their JSON.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar, Optional

from pydantic import Field, field_validator, model_validator

from .errors import ConfigError
from .leaf_module_section import LeafModuleConfig
from .pydantic_errors import show_value
from .section import NoEffect, Section
from .types import (
    AutoBool,
    AutoFraction,
    AutoInt,
    AutoNonNegBudget,
    AutoNonNegInt,
    AutoPosInt,
    AutoStage,
    OffloadDevice,
    Str,
)


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: where ZeRO-3 keeps the parameter shards."""

    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "max_in_cpu": "NVMe parameter offload reads shards into the buffer pool; there is no CPU cache to bound",
    }

    device: OffloadDevice = "none"
    """none (accelerator memory), cpu, or nvme."""
    nvme_path: Optional[Str] = None
    """Directory of the swap files; required when device is nvme."""
    pin_memory: AutoBool = False
    """Use page-locked CPU memory for faster host-device copies."""
    buffer_count: AutoPosInt = 5
    """Number of swap buffers for NVMe offload."""
    buffer_size: AutoPosInt = int(1e8)
    """Elements per NVMe swap buffer."""
    max_in_cpu: AutoNonNegInt = int(1e9)
    """Parameter elements kept in CPU memory when offloading to NVMe."""


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where the optimizer state lives and steps."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "pipeline": (None, "", "NVMe swapping always overlaps the step (pipeline_read / pipeline_write)"),
    }
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "fast_init": "optimizer state is created lazily on the host or in the swap files either way",
        "ratio": "the whole optimizer state is offloaded (a partial ratio is a GPU-side speed trade-off)",
        "pipeline_read": "the next chunk's swap-in always overlaps the step of this one (offload/nvme_optimizer.py)",
        "pipeline_write": "swap-outs are always written asynchronously while the next chunk steps",
    }

    device: OffloadDevice = "none"
    """none (accelerator memory), cpu, or nvme."""
    nvme_path: Optional[Str] = None
    """Directory of the swap files; required when device is nvme."""
    pin_memory: AutoBool = False
    """Use page-locked CPU memory for faster host-device copies."""
    buffer_count: AutoPosInt = 4
    """Number of swap buffers for NVMe offload of optimizer state."""
    fast_init: AutoBool = False
    """Speed up optimizer-state initialisation when offloading to NVMe."""
    ratio: AutoFraction = 1.0
    """Fraction of the optimizer state (and step) placed on the offload device."""
    pipeline_read: AutoBool = False
    """Overlap NVMe swap-in with the step (DeepSpeed's switch; always done here)."""
    pipeline_write: AutoBool = False
    """Overlap NVMe swap-out with the step (DeepSpeed's switch; always done here)."""

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived flag: whether either swap direction was asked to be pipelined."""
        return self.pipeline_read is True or self.pipeline_write is True


class ZeroConfig(Section):
    """``zero_optimization``: ZeRO sharding of optimizer state, gradients and parameters."""

    # DeepSpeed's pydantic fields are the unprefixed names, with the stage3_* spellings as aliases;
    # both are accepted (here the stage3_* name is the field, as users mostly write it).
    ALIASES: ClassVar[dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        **{name: f"stage3_{name}" for name in (
            "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
            "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
            "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
            "partition_stream_chunk_size")},
    }
    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset(
        {
            "zenflow", "zeropp_loco_param", "legacy_stage1",
            "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory", "stage3_use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential", "stage3_partition_stream_chunk_size",
        }
    )
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "contiguous_gradients": "gradients always accumulate in contiguous flat buffers",
        "reduce_scatter": "stages 1-2 always reduce to each gradient's owner; the result is the same average",
        "use_multi_rank_bucket_allreduce": "each bucket is one collective over the data-parallel group",
        "allgather_partitions": "updated shards are always all-gathered (same values as broadcasts)",
        "load_from_fp32_weights": "checkpoints always restore the fp32 masters themselves",
        "stage3_model_persistence_threshold": "persistence is decided per unit (stage3_param_persistence_threshold)",
        "stage3_max_reuse_distance": "stage 3 releases each unit after use and prefetches by recorded order",
        "stage3_module_granularity_threshold": "stage-3 units are transformer blocks (or modules owning parameters)",
        "round_robin_gradients": "host copies of gradients are issued as each bucket's reduction completes",
        "memory_efficient_linear": "stage 3 keeps only the unit being computed gathered, with torch's own linear",
        "mics_hierarchical_params_gather": "MiCS is not implemented (mics_shard_size must stay -1)",
        "elastic_checkpoint": "every checkpoint loads at another data-parallel size (state is saved by parameter "
                              "name, not by rank partition)",
        "pipeline_loading_checkpoint": "ranks need not take turns loading to bound host memory: each reads only "
                                       "its own pieces from memory-mapped files",
    }

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """DeepSpeed's ``cpu_offload`` / ``cpu_offload_param`` booleans become ``offload_optimizer`` /
        ``offload_param`` with device cpu; ``cpu_offload_use_pin_memory`` sets ``pin_memory`` of both. An
        offload block given as null is no offload, as DeepSpeed reads it."""
        raw = {key: value for key, value in raw.items()
               if not (key in ("offload_optimizer", "offload_param") and value is None)}
        for legacy, modern in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if legacy not in raw:
                continue
            value, path = raw.pop(legacy), f"{prefix}.{legacy}"
            if not isinstance(value, bool):
                raise ConfigError(path, f"expected true or false, got {show_value(value)}")
            if modern in raw:
                raise ConfigError(path, f"legacy key given together with '{modern}'; keep only '{prefix}.{modern}'")
            if value:
                raw[modern] = {"device": "cpu"}
            notes.append((path, f"legacy key: {prefix}.{modern}.device = {'cpu' if value else 'none'}"))
        if "cpu_offload_use_pin_memory" in raw:
            value, path = raw.pop("cpu_offload_use_pin_memory"), f"{prefix}.cpu_offload_use_pin_memory"
            if not isinstance(value, bool):
                raise ConfigError(path, f"expected true or false, got {show_value(value)}")
            for modern in ("offload_optimizer", "offload_param"):
                section = raw.get(modern)
                if isinstance(section, dict) and "pin_memory" not in section:
                    raw[modern] = {**section, "pin_memory": value}
            notes.append((path, f"legacy key: pin_memory = {str(value).lower()} in the offload sections"))
        return raw

    stage: AutoStage = 0
    """ZeRO stage: 0 plain data parallel, 1 shard optimizer state, 2 also gradients, 3 also parameters."""
    contiguous_gradients: AutoBool = True
    """Copy gradients into one contiguous buffer as they are produced, avoiding fragmentation."""
    reduce_scatter: AutoBool = True
    """Average gradients with reduce-scatter (each rank receives its shard) instead of all-reduce."""
    reduce_bucket_size: AutoNonNegInt = int(5e8)
    """Gradient elements reduced per collective call."""
    use_multi_rank_bucket_allreduce: AutoBool = True
    """Combine the reduce buckets of several ranks into one all-reduce."""
    allgather_partitions: AutoBool = True
    """Gather updated parameter shards with all-gather (true) or a series of broadcasts (false)."""
    allgather_bucket_size: AutoNonNegInt = int(5e8)
    """Parameter elements all-gathered per collective call."""
    overlap_comm: Optional[AutoBool] = None
    """Overlap gradient reduction with the backward pass; unset means true for stage 3, false otherwise."""
    load_from_fp32_weights: AutoBool = True
    """Initialise fp32 master weights from the fp32 copies in a checkpoint rather than the 16-bit model."""
    elastic_checkpoint: AutoBool = False
    """Legacy elastic checkpoints that reload on a different data-parallel size (zerotune's always do)."""
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    """Optimizer state offload (stages 1-3)."""
    sub_group_size: AutoNonNegInt = int(1e9)
    """Elements per optimizer sub-group stepped at once (limits offload memory)."""
    stage3_prefetch_bucket_size: AutoNonNegBudget = int(5e7)
    """Parameter elements fetched ahead of use in stage 3 (a fraction, as TRL computes it, is rounded down)."""
    stage3_param_persistence_threshold: AutoNonNegInt = int(1e5)
    """Parameters smaller than this many elements stay unpartitioned in stage 3."""
    stage3_model_persistence_threshold: AutoNonNegInt = sys.maxsize
    """Upper bound on the total elements kept unpartitioned by the persistence threshold."""
    stage3_max_live_parameters: AutoNonNegInt = int(1e9)
    """Gathered parameter elements kept resident before releasing in stage 3."""
    stage3_max_reuse_distance: AutoNonNegInt = int(1e9)
    """A parameter reused within this many elements is not released in stage 3."""
    stage3_gather_16bit_weights_on_model_save: AutoBool = False
    """Gather the full 16-bit weights when saving the model in stage 3 (alias stage3_gather_fp16_weights_on_model_save).
    """
    stage3_module_granularity_threshold: AutoNonNegInt = 0
    """Modules finer than this parameter-per-submodule ratio are fetched as one unit; 0 disables."""
    ignore_unused_parameters: AutoBool = True
    """Tolerate parameters that receive no gradient instead of failing (stage 2)."""
    round_robin_gradients: AutoBool = False
    """Parallelise gradient copies to CPU among ranks (stages 1-2 with CPU offload)."""
    zero_hpz_partition_size: AutoPosInt = 1
    """ZeRO++ hierarchical partitioning: ranks in the secondary parameter group; 1 disables."""
    zero_quantized_weights: AutoBool = False
    """ZeRO++: quantize weights for the all-gather."""
    zero_quantized_nontrainable_weights: AutoBool = False
    """ZeRO++: store frozen weights quantized."""
    zero_quantized_gradients: AutoBool = False
    """ZeRO++: quantize gradients for the reduce."""
    mics_shard_size: AutoInt = -1
    """MiCS: ranks per parameter shard group; -1 disables MiCS."""
    mics_hierarchical_params_gather: AutoBool = False
    """MiCS: gather parameters hierarchically (intra-node then inter-node)."""
    memory_efficient_linear: AutoBool = True
    """Use the memory-efficient linear autograd function in stage 3."""
    pipeline_loading_checkpoint: AutoBool = False
    """DeepSpeed's stage-3 checkpoint loading one local rank at a time (to bound host memory while loading)."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """ZeRO-3 leaves (gathered whole) by class, name or name suffix; defaults: the HF MoE blocks."""

    @model_validator(mode="after")
    def _dynamic_defaults(self) -> "ZeroConfig":
        # DeepSpeed's dynamic default: overlapping only pays off once parameters are sharded.
        if self.overlap_comm is None and isinstance(self.stage, int):
            self.overlap_comm = self.stage == 3
        return self

    @field_validator("mics_shard_size")
    @classmethod
    def _mics_disabled_or_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and (value == 0 or value < -1):
            raise ValueError("expected -1 (MiCS disabled) or a positive number of ranks")
        return value
