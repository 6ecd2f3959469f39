"""The small DeepSpeed config sections (everything but ZeRO and the top level).

Key names and defaults follow DeepSpeed's config documentation so an existing
``ds_config.json`` means the same thing here. Free-form ``params`` dicts (optimizer,
scheduler) are validated later by the builders that know each type's signature.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, StrictBool, field_validator, model_validator

from .section import NoEffect, Section
from .types import (
    AutoBool,
    AutoNonNegFloat,
    AutoNonNegInt,
    AutoPosInt,
    OptAutoPosInt,
    PosFloat,
    Str,
)


class OptimizerConfig(Section):
    """``optimizer``: which optimizer to build and its constructor arguments."""

    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset({"legacy_fusion"})

    type: Str
    """Optimizer name as DeepSpeed spells it (Adam, AdamW, SGD, ...) or any torch.optim class name."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...); values may be "auto"."""


class SchedulerConfig(Section):
    """``scheduler``: which learning-rate schedule to build and its arguments."""

    type: Str
    """Scheduler name as DeepSpeed spells it (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the schedule (warmup_num_steps, total_num_steps, ...); values may be "auto"."""


class FP16Config(Section):
    """``fp16``: float16 mixed precision with a dynamic (or static) loss scaler."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "fp16_master_weights_and_grads": (lambda v: v is False, "false", "masters and gradients are always fp32"),
    }
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "auto_cast": "the engine always casts floating-point inputs to the training dtype",
    }

    enabled: AutoBool = False
    """Train with float16 compute and fp32 master weights."""
    auto_cast: AutoBool = False
    """Cast the model inputs to float16 automatically."""
    loss_scale: AutoNonNegFloat = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: AutoNonNegInt = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: AutoPosInt = 1000
    """Overflow-free steps after which the dynamic scale is doubled."""
    hysteresis: AutoPosInt = 2
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: AutoBool = False
    """Refill the hysteresis budget after every overflow-free step, not only at window ends."""
    min_loss_scale: AutoNonNegFloat = 1.0
    """The dynamic scale never drops below this value."""


class BF16Config(Section):
    """``bf16`` (alias ``bfloat16``): bfloat16 mixed precision; needs no loss scaling."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "immediate_grad_update": (None, "", "gradients always accumulate in fp32 buffers as backward produces them"),
        "bf16_master_weights_and_grads": (lambda v: v is False, "false", "masters and gradients are always fp32"),
        "bf16_optimizer_states": (lambda v: v is False, "false", "optimizer state is always fp32"),
    }

    enabled: AutoBool = False
    """Train with bfloat16 compute and fp32 master weights."""
    check_grad_overflow: AutoBool = True
    """Skip a step whose gradient norm is not finite (as in every precision); false applies it anyway, as
    DeepSpeed's bf16 does then (the non-finite values reach the weights)."""


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: how checkpointed activations are stored."""

    partition_activations: AutoBool = False
    """Shard checkpointed activations across model-parallel ranks."""
    cpu_checkpointing: AutoBool = False
    """Keep the inputs of checkpointed regions in host memory (pinned) and move them back for the recompute."""
    contiguous_memory_optimization: AutoBool = False
    """Copy checkpointed activations into one contiguous buffer to avoid fragmentation."""
    number_checkpoints: OptAutoPosInt = None
    """How many transformer blocks apply_activation_checkpointing checkpoints, evenly spaced; None: every block.

    (DeepSpeed sizes its contiguous buffer with it; zerotune has no contiguous buffer yet.)"""
    synchronize_checkpoint_boundary: AutoBool = False
    """Synchronize devices at each checkpoint boundary (for debugging and timing)."""
    profile: AutoBool = False
    """Log the forward and backward time of each checkpointed function."""
    wrap_blocks: Optional[StrictBool] = None
    """zerotune extension: whether ``initialize`` checkpoints the model's transformer blocks itself.

    None (default): when the model declares them (a Hugging Face ``_no_split_modules``) and its own
    gradient checkpointing is off; a model without declared blocks is left as it is, and the block
    then only configures ``zerotune.checkpointing`` (``deepspeed.checkpointing``), as in DeepSpeed.
    true: always (an error if no block is found); false: never."""


TORCH_COMPILE_KWARGS = ("mode", "fullgraph", "dynamic", "options", "disable")
_DEEPCOMPILE_OPTIONS = (
    "free_activation", "free_activation_threshold", "offload_activation", "offload_activation_pin_memory",
    "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
    "keep_int_input_tensors", "keep_all_input_tensors", "passes")


class CompileConfig(Section):
    """``compile``: ``torch.compile`` of the engine's module (``engine.compile()`` does it from a script).

    DeepSpeed 0.14's form (``enabled``, ``backend``, ``kwargs``) compiles at ``initialize``. DeepCompile
    (``deepcompile: true``, graph passes that move ZeRO's collectives into the graph) is not zerotune's:
    refused; its options change nothing while it is off."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "deepcompile": (lambda v: v is False, "false", "DeepCompile is off"),
        **{key: (None, "", "a DeepCompile option; DeepCompile is off") for key in _DEEPCOMPILE_OPTIONS},
    }

    enabled: AutoBool = False
    """Compile the model at ``initialize`` (as ``engine.compile(backend, kwargs)``)."""
    backend: Str = "inductor"
    """The ``torch.compile`` backend ("inductor", "aot_eager", "eager", or a registered one)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further ``torch.compile`` arguments: ``mode``, ``fullgraph``, ``dynamic``, ``options``."""

    @field_validator("kwargs")
    @classmethod
    def _torch_compile_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(TORCH_COMPILE_KWARGS))
        if unknown:
            raise ValueError(f"{unknown} are not torch.compile arguments; valid: {', '.join(TORCH_COMPILE_KWARGS)} "
                             "(the backend has a key of its own)")
        return value


class PipelineConfig(Section):
    """``pipeline``: pipeline-parallel layout."""

    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset({"pipe_partitioned", "grad_partitioned"})
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "seed_layers": "layers are seeded where they are built: PipelineModule(..., seed_layers=True, base_seed=...) "
                       "seeds layer i with base_seed + i before initialize reads the config, and a Hugging Face "
                       "model arrives built (DeepSpeed's engine does not read this key either)",
    }

    stages: AutoPosInt = 1
    """Number of pipeline stages; 1 means no pipeline parallelism."""
    partition: Str = "best"
    """How layers are split over stages: "parameters", "uniform", "type:REGEX"; DeepSpeed's default "best" means
    "parameters"."""
    seed_layers: AutoBool = False
    """Give each layer its own random seed so stages initialise reproducibly."""
    activation_checkpoint_interval: AutoNonNegInt = 0
    """Checkpoint activations every this many layers inside a stage; 0 disables it. A positive value overrides
    the ``PipelineModule``'s own ``activation_checkpoint_interval``, as in DeepSpeed."""
    use_reentrant: AutoBool = True
    """false: the stage checkpoints with ``deepspeed.checkpointing.non_reentrant_checkpoint`` instead of the
    module's ``activation_checkpoint_func``, as in DeepSpeed. zerotune's ``checkpoint`` is non-reentrant under
    either name; a script's own reentrant function gets the first stage's inputs marked as requiring grad."""
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """zerotune extension: micro-batch schedule, one-forward-one-backward or fill-drain (GPipe)."""

    @field_validator("partition")
    @classmethod
    def _known_partition(cls, value: str) -> str:
        if value in ("best", "parameters", "uniform") or value.startswith("type:"):
            return value
        raise ValueError("expected 'parameters', 'uniform', 'best' or 'type:REGEX'")


class GradientCompressionConfig(Section):
    """``gradient_compression`` (zerotune): Top-K sparsified gradient reductions with error feedback."""

    method: Literal["topk"] = "topk"
    """Compression method; "topk" keeps the largest-magnitude entries of each gradient bucket."""
    ratio: PosFloat = 0.01
    """Fraction of each bucket's entries sent per reduction, in (0, 1]; 1.0 is the uncompressed run."""
    error_feedback: AutoBool = True
    """Carry what was not sent into the next reduction (keeps convergence); false drops it."""
    warmup_steps: AutoNonNegInt = 0
    """Optimizer steps with dense gradients before compression starts."""
    min_bucket_numel: AutoNonNegInt = 0
    """Buckets with fewer elements stay dense (compression overhead outweighs the saving)."""

    @field_validator("ratio")
    @classmethod
    def _at_most_one(cls, value: float) -> float:
        if value > 1:
            raise ValueError("expected a fraction in (0, 1]")
        return value


class TensorParallelLayerSpec(Section):
    """One rule of ``tensor_parallel.partition_config.layer_specs``: how matching layers are split."""

    patterns: list[Str]
    """Regular expressions matched from the start of parameter names (as DeepSpeed's ``re.match``), e.g.
    ``.*\\.q_proj\\.weight$``."""
    partition_type: Literal["column", "row", "skip"]
    """column: split the output features; row: split the input features; skip: leave replicated."""
    parts: AutoPosInt = 1
    """(zerotune) fused sub-blocks along the output features split separately, e.g. 3 for a fused q|k|v."""
    gather_output: AutoBool = False
    """column: all-gather the split output, so the next module sees all of it (e.g. an LM head read by the loss)."""
    shape: Optional[list[Any]] = None
    """(DeepSpeed) fused sub-parameters, e.g. ``[3, -1]`` or ``[[h, h, h], -1]``: equal parts become ``parts``."""
    partition_dim: Optional[int] = None
    """(DeepSpeed) the dim ``shape`` splits at; zerotune splits fused parts at 0 (the output features) only."""

    @model_validator(mode="after")
    def _shape_as_parts(self) -> TensorParallelLayerSpec:
        if self.shape is not None:
            from zerotune.parallel.tensor.plans import parts_from_shape

            self.parts = parts_from_shape(self.shape, self.partition_dim, self.partition_type)
        elif self.partition_dim is not None:
            raise ValueError("partition_dim applies to a fused 'shape' only")
        return self

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        import re

        if not value:
            raise ValueError("needs at least one pattern")
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"pattern {pattern!r} is not a valid regular expression ({error})") from None
        return value


class TensorParallelPartitionConfig(Section):
    """``tensor_parallel.partition_config``: user layer rules, before (or instead of) the built-in plans."""

    use_default_specs: AutoBool = True
    """Also apply the built-in plan of the model's architecture to layers no user rule matched."""
    layer_specs: list[TensorParallelLayerSpec] = Field(default_factory=list)
    """Rules tried in order; the first whose pattern matches a layer's weight name decides."""


class TensorParallelConfig(Section):
    """``tensor_parallel``: automatic tensor parallelism for training (DeepSpeed AutoTP)."""

    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset(
        {"tp", "dtype", "injection_policy_tuple", "keep_module_on_host"}
    )
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "tp_overlap_comm": "zerotune's tensor-parallel all-reduces are not overlapped with the matmuls (the same "
                           "results, without the overlap)",
    }

    autotp_size: AutoNonNegInt = 0
    """Tensor-parallel degree; 0 or 1 disables tensor parallelism."""
    partition_config: TensorParallelPartitionConfig = Field(default_factory=TensorParallelPartitionConfig)
    """Which layers are split and how (default: the built-in plan of GPT-2, Llama, Mistral, Qwen2 or BERT)."""
    tp_overlap_comm: AutoBool = False
    """(DeepSpeed) overlap the column-parallel backward all-reduce with compute; no effect in zerotune."""


class MonitorConfig(Section):
    """``tensorboard`` / ``csv_monitor``: write training metrics to files on rank 0."""

    enabled: AutoBool = False
    """Write the metrics."""
    output_path: Str = ""
    """Directory for the event/CSV files; "" means the current directory."""
    job_name: Str = "DeepSpeedJobName"
    """Sub-directory (run name) under output_path."""


class WandbConfig(Section):
    """``wandb``: log training metrics to Weights & Biases on rank 0."""

    enabled: AutoBool = False
    """Log to Weights & Biases."""
    team: Optional[Str] = None
    """W&B entity (team) name."""
    group: Optional[Str] = None
    """W&B run group."""
    project: Str = "deepspeed"
    """W&B project name."""


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``: parallel checkpoint writing."""

    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "pipeline_stage": "each pipeline stage's ranks always write their own files",
    }

    pipeline_stage: AutoBool = False
    """Each pipeline stage writes its own part of the checkpoint in parallel."""


class CheckpointConfig(Section):
    """``checkpoint``: checkpoint saving and loading behaviour."""

    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "load_universal": "no conversion is needed: every zerotune checkpoint loads at any layout (DeepSpeed's "
                          "universal-format directories are not read; its ZeRO checkpoints are)",
        "use_node_local_storage": "true is refused; every rank writes its files under the save directory",
    }

    save_dir: Optional[Str] = None
    """Default directory of ``engine.save_checkpoint()`` / ``load_checkpoint()`` when called without one, and
    where ``auto_resume`` looks (zerotune extension)."""
    auto_resume: AutoBool = False
    """At ``initialize``, resume from the newest complete, verified checkpoint in ``save_dir`` if there is one
    (an older one when the newest is damaged): with ``zerotune run --max-restarts N``, a job whose rank died
    restarts and continues from its last checkpoint (zerotune extension)."""
    keep_last: OptAutoPosInt = None
    """Keep only the newest N checkpoints in the save directory (older tags are deleted after each save;
    the one ``latest`` names is always kept); unset keeps all (zerotune extension)."""
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """What to do when ranks save under different tags: Ignore, Warn or Fail (case-insensitive)."""
    load_universal: AutoBool = False
    """Load a universal (topology-independent) checkpoint."""
    use_node_local_storage: AutoBool = False
    """Every node writes its shards to its own local storage instead of a shared file system."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel writing options."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalise(cls, value: Any) -> Any:
        # DeepSpeed compares case-insensitively ("fail" == "FAIL" == "Fail").
        return value.capitalize() if isinstance(value, str) else value


class AioConfig(Section):
    """``aio``: asynchronous I/O used by NVMe offload."""

    # DeepSpeed renamed thread_count to intra_op_parallelism (v0.15); both spell the same knob here.
    ALIASES: ClassVar[dict[str, str]] = {"intra_op_parallelism": "thread_count"}
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "use_gds": "GPUDirect Storage is not used (true is refused)",
        "single_submit": "libaio's submission batching: swap-file requests here are positioned reads and writes "
                         "on a thread pool (thread_count x queue_depth in flight), with nothing to batch",
        "overlap_events": "libaio's event overlap: each thread-pool request completes on its own, so submitting "
                          "and waiting always overlap",
    }

    block_size: AutoPosInt = 1048576
    """Bytes per I/O request."""
    queue_depth: AutoPosInt = 8
    """I/O requests kept in flight."""
    thread_count: AutoPosInt = 1
    """I/O worker threads."""
    single_submit: AutoBool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: AutoBool = True
    """Overlap submitting new requests with waiting for completed ones."""
    use_gds: AutoBool = False
    """Use NVIDIA GPUDirect Storage."""


class LRScalingConfig(Section):
    """``lr_scaling`` (zerotune extension): scale the learning rate with the global batch size."""

    rule: Literal["linear"] = "linear"
    """Scaling rule; "linear" means lr x train_batch_size / base_batch_size."""
    base_batch_size: AutoPosInt
    """The global batch size the configured lr was tuned for."""


__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "FP16Config",
    "LRScalingConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "WandbConfig",
]
