"""``ZeroTuneConfig``: the whole DeepSpeed-style config as one typed object.

Attribute names are exactly DeepSpeed's JSON keys, so ``cfg.zero_optimization.stage``
reads like the JSON it came from. A value may be the string ``"auto"`` (HF Trainer
style) until :func:`zerotune.config.resolve_config` replaces it; after a strict
resolve no field holds ``"auto"``.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, ClassVar, Literal, Optional

from pydantic import Field, PrivateAttr, field_validator

from .comms_logger_section import CommsLoggerConfig
from .curriculum_section import CurriculumLearningConfig, DataEfficiencyConfig
from .data_types import DataTypesConfig
from .elasticity import ElasticityConfig
from .flops_profiler_section import FlopsProfilerConfig
from .section import NoEffect, Section
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CompileConfig,
    FP16Config,
    GradientCompressionConfig,
    LRScalingConfig,
    MonitorConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
    WandbConfig,
)
from .types import AutoBool, AutoNonNegFloat, AutoPosFloat, AutoPosInt, OptAutoPosInt
from .zero_section import ZeroConfig

# DeepSpeed top-level blocks and keys zerotune deliberately does not model. Naming them
# turns "unknown key" into "a DeepSpeed feature zerotune does not support".
UNSUPPORTED_BLOCKS = frozenset(
    {
        "compression_training", "sparse_attention", "quantize_training", "weight_quantization", "moe", "mup",
        "zenflow", "activation_quantization",
    }
)


# The level names ``log_level`` accepts, in any case (monitor/logging.set_level applies one).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _disabled(block: Any) -> bool:
    """A DeepSpeed feature block switched off (``{"enabled": false}``), which asks for nothing."""
    return isinstance(block, dict) and not block.get("enabled", False)


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: any(value is a or (not isinstance(a, bool) and value == a) for a in allowed)


# Top-level DeepSpeed keys accepted without a field: the values for which they change nothing here.
_NO_EFFECT_TOP: dict[str, NoEffect] = {
    **{block: (_disabled, '{"enabled": false}', "the feature is off") for block in (
        "autotuning", "amp", "eigenvalue",
        "progressive_layer_drop", "hybrid_engine", "nebula", "comet", "torch_autocast")},
    "timers": (None, "", "the throughput timer always runs (engine.tput_timer)"),
    # keys DeepSpeed itself never reads (its config ignores unknown keys); LLaMA-Factory's shipped
    # examples/deepspeed/ds_z*_config.json set both
    "comms_config": (None, "", "DeepSpeed does not read it either (its collectives log is comms_logger)"),
    "monitor_config": (None, "", "DeepSpeed does not read it either (its monitors are the tensorboard, wandb, "
                                 "csv_monitor and comet blocks)"),
    "zero_force_ds_cpu_optimizer": (None, "", "offloaded optimizer steps run torch's kernels for any torch optimizer"),
    "cuda_visible_devices": (None, "",
                             "device visibility is the launcher's: set CUDA_VISIBLE_DEVICES in the environment"),
    "dump_state": (_is(False), "false", "there is no state dump"),
    "disable_allgather": (_is(False), "false", "updated shards are always all-gathered"),
    "graph_harvesting": (_is(False), "false", "no CUDA-graph harvesting"),
    "use_data_before_expert_parallelism": (_is(False), "false", "there is no expert parallelism"),
    "seq_parallel_comm_data_type": (_is("fp32"), '"fp32"', "gradients are always reduced in fp32"),
    "seq_parallel_communication_data_type": (_is("fp32"), '"fp32"', "gradients are always reduced in fp32"),
}


class ZeroTuneConfig(Section):
    """A zerotune training config: DeepSpeed's JSON schema plus the ``lr_scaling`` extension."""

    ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    UNSUPPORTED: ClassVar[frozenset[str]] = UNSUPPORTED_BLOCKS
    NO_EFFECT: ClassVar[dict[str, NoEffect]] = _NO_EFFECT_TOP
    FEATURES: ClassVar[dict[str, str]] = {
        "hybrid_engine": "DeepSpeed's Hybrid Engine, DeepSpeed-Chat's --enable_hybrid_engine: inference kernels for "
                         "generate() inside a training engine; without it generate() runs the model's own modules",
    }
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "zero_allow_untested_optimizer": "every torch optimizer runs on the shards (Lamb is refused at stages 1-3)",
        "sparse_gradients": "gradients are reduced dense, nn.Embedding(sparse=True)'s too: the same values; "
                            "DeepSpeed's sparse all-gather changes only the bytes sent",
    }

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """DeepSpeed's oldest form ``"zero_optimization": true`` means stage 1 (false: stage 0)."""
        if isinstance(raw.get("zero_optimization"), bool):
            stage = int(raw["zero_optimization"])
            raw = {**raw, "zero_optimization": {"stage": stage}}
            notes.append(("zero_optimization", f"legacy boolean form: zero_optimization.stage = {stage}"))
        return raw

    train_batch_size: OptAutoPosInt = None
    """Global batch per optimizer step = micro batch x accumulation steps x data-parallel size."""
    train_micro_batch_size_per_gpu: OptAutoPosInt = None
    """Samples per rank per forward/backward pass."""
    gradient_accumulation_steps: OptAutoPosInt = None
    """Micro batches accumulated before each optimizer step."""
    optimizer: Optional[OptimizerConfig] = None
    """Optimizer to build; None means the caller passes its own optimizer."""
    scheduler: Optional[SchedulerConfig] = None
    """Learning-rate schedule to build; None means none (or the caller's own)."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 mixed precision and loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bfloat16 mixed precision (alias key ``bfloat16``)."""
    gradient_clipping: AutoNonNegFloat = 0.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO sharding and offload."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    """Storage of checkpointed activations."""
    gradient_compression: Optional[GradientCompressionConfig] = None
    """Top-K gradient compression of the data-parallel reductions (zerotune); absent = dense."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """torch.compile of the model (DeepSpeed's ``compile`` block; DeepCompile refused)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallelism (AutoTP)."""
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)
    """DeepSpeed's legacy seqlen curriculum, applied by the engine's forward (config/curriculum_section.py)."""
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    """DeepSpeed's data efficiency: its analyzer-free curriculum over the engine's data loader."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """DeepSpeed's ``grad_accum_dtype`` (no effect here: gradients accumulate in fp32; config/data_types.py)."""
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    """DeepSpeed's elastic batch: when enabled it chooses the batch triple for the data-parallel size
    (config/elasticity.py, config/elastic_batch.py)."""
    sequence_parallel_size: AutoPosInt = 1
    """Ulysses sequence-parallel degree; 1 disables sequence parallelism."""
    steps_per_print: AutoPosInt = 10
    """Log progress every this many optimizer steps."""
    comm_timeout_s: Optional[AutoPosFloat] = 600.0
    """zerotune: a collective still pending after this many seconds (a rank stopped, died or diverged) makes the
    rank print the pending collective and every thread's stack and exit (status 75), instead of waiting for
    torch's 30-minute timeout; null turns the watchdog off. Checkpoint saves wait in collectives for the slowest
    writer: keep it above that."""
    collective_guard: AutoBool = True
    """zerotune: before each engine phase that communicates, ranks compare a running hash of the collectives
    each issued (one small all-gather on a group of its own) and the configs at initialize; ranks that diverged
    (a skipped or extra micro-step, a checkpoint saved on one rank) all stop with CollectiveMismatch naming
    each rank's last collectives, instead of pairing unrelated collectives. false turns it off."""
    max_consecutive_skipped_steps: AutoPosInt = 20
    """zerotune: stop with an error after this many optimizer steps in a row were skipped for a non-finite
    gradient norm (fp16 overflows included: a dynamic loss scale recovers in far fewer), in every precision."""
    log_level: Optional[str] = None
    """The "zerotune" logger's level from ``initialize`` on (DeepSpeed's logger under the alias): debug, info,
    warning, error or critical, in any case; None leaves the level as it is."""
    wall_clock_breakdown: AutoBool = False
    """Time forward, backward and step separately and log the breakdown."""
    memory_breakdown: AutoBool = False
    """Log accelerator memory use at each step."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Time collectives by op and message size (every collective's calls and bytes are counted regardless)."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """DeepSpeed's flops profiler: one step's forward profiled and printed on rank 0
    (config/flops_profiler_section.py)."""
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    """TensorBoard event-file logging."""
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """CSV metrics logging."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint behaviour."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous I/O for NVMe offload."""
    prescale_gradients: AutoBool = False
    """Divide gradients by the data-parallel size before the all-reduce instead of after."""
    gradient_predivide_factor: AutoPosFloat = 1.0
    """Divide gradients by this factor before the all-reduce and by dp_size/factor after (overflow control)."""
    zero_allow_untested_optimizer: AutoBool = False
    """Accepted for DeepSpeed compatibility; zerotune runs any torch optimizer with ZeRO."""
    sparse_gradients: AutoBool = False
    """DeepSpeed's sparse reduction of embedding gradients; here they are reduced dense (no effect on the values).
    ``engine.sparse_tensor_module_names`` lists the embedding weights it names, as DeepSpeed's does."""
    dataloader_drop_last: AutoBool = False
    """Drop the last incomplete batch of the engine-built data loader."""
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16", "bfp16"]] = None
    """dtype used for gradient communication; None means the training dtype."""
    lr_scaling: Optional[LRScalingConfig] = None
    """zerotune extension: scale the learning rate with the global batch size."""

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_means_never(cls, value: Any) -> Any:
        # accelerate writes float("inf") (JSON Infinity): never print, as DeepSpeed reads it.
        if isinstance(value, float) and math.isinf(value) and value > 0:
            return sys.maxsize
        return value

    @field_validator("log_level")
    @classmethod
    def _a_level_name(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value.lower() not in LOG_LEVELS:
            raise ValueError(f"{value!r} is not a level name; valid: {', '.join(LOG_LEVELS)} (any case)")
        return value

    _provenance: dict[str, str] = PrivateAttr(default_factory=dict)
    _notes: list[tuple[str, str]] = PrivateAttr(default_factory=list)

    @property
    def provenance(self) -> dict[str, str]:
        """Dotted leaf path -> "file" | "default" | "auto" | "inferred": where each value came from."""
        return self._provenance

    @property
    def notes(self) -> list[tuple[str, str]]:
        """(dotted key, message) for each given key zerotune rewrote or that has no effect here: legacy
        spellings mapped to their modern form, and accepted DeepSpeed keys that change nothing."""
        return [*self._notes, *_no_effect_field_notes(self)]

    def to_dict(self) -> dict[str, Any]:
        """The values as a DeepSpeed-style plain dict (for checkpoints and logging)."""
        return self.model_dump()




def _no_effect_field_notes(cfg: ZeroTuneConfig) -> list[tuple[str, str]]:
    """Notes for the modelled-but-unread fields (``NO_EFFECT_FIELDS``) the config file sets."""
    notes = []

    def walk(node: Any, prefix: str) -> None:
        for name in type(node).model_fields:
            path = f"{prefix}.{name}" if prefix else name
            value = getattr(node, name)
            if isinstance(value, Section):
                walk(value, path)
            elif name in type(node).NO_EFFECT_FIELDS and cfg.provenance.get(path) == "file":
                notes.append((path, f"no effect here: {type(node).NO_EFFECT_FIELDS[name]}"))

    walk(cfg, "")
    return notes


__all__ = ["UNSUPPORTED_BLOCKS", "ZeroTuneConfig"]
