"""``ZeroTuneConfig``: the whole DeepSpeed-style config as one typed object.

Attribute names are exactly DeepSpeed's JSON keys, so ``cfg.zero_optimization.stage``
reads like the JSON it came from. A value may be the string ``"auto"`` (HF Trainer
style) until :func:`zerotune.config.resolve_config` replaces it; after a strict
resolve no field holds ``"auto"``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, PrivateAttr

from .section import Section
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
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
        "flops_profiler", "compression_training", "autotuning", "elasticity", "data_efficiency",
        "curriculum_learning", "sparse_attention", "amp", "eigenvalue", "progressive_layer_drop",
        "hybrid_engine", "quantize_training", "nebula", "comms_logger", "weight_quantization",
        "comet", "compile", "torch_autocast", "data_types", "dump_state", "sparse_gradients",
        "disable_allgather", "zero_force_ds_cpu_optimizer", "graph_harvesting",
        "use_data_before_expert_parallelism", "timers", "seq_parallel_communication_data_type",
        "moe", "mup", "zenflow", "activation_quantization",
    }
)


class ZeroTuneConfig(Section):
    """A zerotune training config: DeepSpeed's JSON schema plus the ``lr_scaling`` extension."""

    ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    UNSUPPORTED: ClassVar[frozenset[str]] = UNSUPPORTED_BLOCKS

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
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallelism (AutoTP)."""
    sequence_parallel_size: AutoPosInt = 1
    """Ulysses sequence-parallel degree; 1 disables sequence parallelism."""
    steps_per_print: AutoPosInt = 10
    """Log progress every this many optimizer steps."""
    wall_clock_breakdown: AutoBool = False
    """Time forward, backward and step separately and log the breakdown."""
    memory_breakdown: AutoBool = False
    """Log accelerator memory use at each step."""
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
    dataloader_drop_last: AutoBool = False
    """Drop the last incomplete batch of the engine-built data loader."""
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16", "bfp16"]] = None
    """dtype used for gradient communication; None means the training dtype."""
    lr_scaling: Optional[LRScalingConfig] = None
    """zerotune extension: scale the learning rate with the global batch size."""

    _provenance: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def provenance(self) -> dict[str, str]:
        """Dotted leaf path -> "file" | "default" | "auto" | "inferred": where each value came from."""
        return self._provenance

    def to_dict(self) -> dict[str, Any]:
        """The values as a DeepSpeed-style plain dict (for checkpoints and logging)."""
        return self.model_dump()


__all__ = ["UNSUPPORTED_BLOCKS", "ZeroTuneConfig"]
