"""One rank's memory for a config and a model, before launch: model state, buckets, activations, peaks.

Model state follows zerotune's own allocation (``states.py``); activations come from a meta-device trace of
one micro-batch forward (``activations.py``); the largest stage-3 unit and the bucket sizes come from the
model's structure and the config. The result is a list of rows, each with where it lives (device, host,
NVMe), so ``zerotune plan`` can print it and the auto layout can compare totals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from zerotune.config import load_config, resolve_config
from zerotune.config.errors import ConfigError, NotSupportedYetError
from zerotune.parallel.composition import refusal
from zerotune.parallel.sequence.ulysses_attention import check_ulysses_split
from zerotune.plan.activations import ActivationProfile, trace_activations
from zerotune.plan.meta_model import PlanModelError, parameter_counts
from zerotune.plan.pipeline import StageShare, in_flight, stage_activations, stage_shares
from zerotune.plan.states import zerotune_model_states

IN_FLIGHT_BUCKETS = 3  # stage 2: one bucket filling and up to two in flight (stage2_sync.py's max_in_flight)


@dataclass(frozen=True)
class Layout:
    stage: int
    dp: int
    precision: str
    micro_batch: int
    gas: int = 1
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline stages; dp = world / (tp x pp x sp)
    sp: int = 1  # sequence-parallel (Ulysses) size: each rank runs 1/sp of every sequence
    optimizer: str = "adamw"
    offload_optimizer: str = "none"
    offload_param: str = "none"
    reduce_bucket: int = int(5e8)
    allgather_bucket: int = int(5e8)
    prefetch_bucket: int = int(5e7)
    overlap_comm: bool | None = True
    """Stage 2 keeps up to two reduce buckets in flight (IN_FLIGHT_BUCKETS held) only with overlap_comm; without,
    one bucket is reused. None: the engine's default for the stage (on at stage 3 only), what a config that does
    not set it gets -- so ``--zero-stage`` overriding the stage also moves the default."""

    @property
    def zero_group(self) -> int:
        """The ranks ZeRO shards over and averages gradients across: the data- and sequence-parallel ranks hold
        the same parameters (the mesh's ``dp_sp``)."""
        return self.dp * self.sp


def asks_for_auto_stage(source: Any) -> bool:
    """``"zero_optimization": {"stage": "auto"}``: the layout is the plan's to choose (``auto.py``)."""
    return load_config(source).zero_optimization.stage == "auto"


def layout_from_config(source: Any, world_size: int) -> Layout:
    """The layout a DeepSpeed-style config describes on ``world_size`` ranks; a stage "auto" reads as 0 here
    (``asks_for_auto_stage`` tells the caller to choose)."""
    config = load_config(source)
    sp = config.sequence_parallel_size
    sp = sp if isinstance(sp, int) and sp > 1 else 1
    tp = config.tensor_parallel.autotp_size
    tp = tp if isinstance(tp, int) and tp > 1 else 1
    pp = config.pipeline.stages if isinstance(config.pipeline.stages, int) else 1
    if world_size % (tp * pp * sp):
        key = "tensor_parallel.autotp_size" if tp > 1 else "pipeline.stages" if pp > 1 else "sequence_parallel_size"
        raise ConfigError(key, f"{tp * pp * sp} model- and sequence-parallel ranks (tp {tp} x pp {pp} x sp {sp}) do "
                               f"not divide the world size {world_size}")
    world_size //= tp * pp * sp  # the data-parallel size
    config = resolve_config(config, dp_world_size=world_size, strict=False)
    zero = config.zero_optimization

    def number(value: Any, default: int) -> int:
        return default if isinstance(value, str) else int(value)

    micro = config.train_micro_batch_size_per_gpu
    precision = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    gas = config.gradient_accumulation_steps
    return Layout(stage=number(zero.stage, 0), dp=world_size, precision=precision, micro_batch=number(micro, 1),
                  gas=number(gas, 1), tp=tp, pp=pp, sp=sp,
                  optimizer=(config.optimizer.type if config.optimizer is not None else "adamw"),
                  offload_optimizer=zero.offload_optimizer.device, offload_param=zero.offload_param.device,
                  reduce_bucket=number(zero.reduce_bucket_size, int(5e8)),
                  allgather_bucket=number(zero.allgather_bucket_size, int(5e8)),
                  prefetch_bucket=number(zero.stage3_prefetch_bucket_size, int(5e7)),
                  overlap_comm=_given_overlap(source))


def _given_overlap(source: Any) -> bool | None:
    """The config's own ``zero_optimization.overlap_comm`` (None when unset or "auto": the stage's default)."""
    config = load_config(source)
    value = config.zero_optimization.overlap_comm
    given = config.provenance.get("zero_optimization.overlap_comm") == "file"  # else the loaded stage's default
    return value if given and isinstance(value, bool) else None


def check_composes(layout: Layout) -> None:
    """What ``initialize`` would refuse (TP or a pipeline with ZeRO 3, ...) is not planned either: the same
    error, naming the key."""
    refused = refusal(layout.stage, layout.offload_optimizer, layout.tp, layout.pp, layout.sp)
    if refused is not None:
        raise NotSupportedYetError(*refused)


@dataclass
class Row:
    name: str
    bytes: int
    where: str = "device"  # device | host | nvme
    note: str = ""


@dataclass
class RankPlan:
    rows: list[Row] = field(default_factory=list)
    activations: ActivationProfile | None = None
    trainable: int = 0
    frozen: int = 0
    lookup: int = 0  # of those, looked up rather than multiplied (an input embedding no matmul uses)
    stage: int | None = None  # the pipeline stage this rank holds (the fullest one), when pipelined

    def total(self, where: str = "device", checkpointing: bool = False) -> int:
        skip = "activations (no checkpointing)" if checkpointing else "activations (checkpointing every block)"
        return sum(r.bytes for r in self.rows if r.where == where and r.name != skip)


def largest_unit_params(model: torch.nn.Module) -> int:
    """Parameters of the largest stage-3 unit (gathered whole for its forward and backward)."""
    from zerotune.zero.stage3.wrap import assign_params, unit_module_names

    units = assign_params(model, unit_module_names(model))
    return max((sum(p.numel() for p in params) for params in units.values()), default=0)


@dataclass(frozen=True)
class ModelProfile:
    """What the plan needs of a model, measured once: parameter counts, the largest stage-3 unit, and the
    activations of one example (they scale with the micro-batch: a transformer's examples do not mix)."""

    trainable: int
    frozen: int
    largest_unit: int
    per_example: ActivationProfile
    seq_len: int  # tokens of each sequence one rank runs (the whole sequence / the sequence-parallel size)
    width: int  # bytes per element of the traced precision
    stages: tuple[StageShare, ...] = ()  # pipeline stages' parameters and blocks (pipeline.py)
    lookup: int = 0
    """Parameters only looked up, never multiplied (no flops per token): the input embedding unless the output
    layer shares it."""
    embedding: int = 0
    """The input embedding's parameters: a lookup on a pipeline's first stage even when tied (the last stage
    multiplies by its own copy)."""


def profile_model(model: torch.nn.Module, seq_len: int, precision: str, task: str = "causal-lm",
                  tp: int = 1, pp: int = 1, sp: int = 1) -> ModelProfile:
    """Counts and a one-example activation trace of one rank of ``model`` (on the meta device; consumed by the
    trace), split over ``tp`` tensor-parallel ranks as zerotune would split it, and its ``pp`` pipeline
    stages' shares. With ``sp`` sequence-parallel ranks a rank runs ``seq_len / sp`` tokens of each sequence
    through everything but attention, and attention on the whole sequence for 1/sp of the heads -- the same
    bytes as its tokens' share for every head -- so the trace is of ``seq_len / sp`` tokens."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and seq_len > limit:
        raise PlanModelError(f"--seq-len {seq_len}: {type(model).__name__} takes at most {limit} positions "
                             "(its config's max_position_embeddings); plan a shorter sequence")
    if seq_len % sp:
        raise PlanModelError(f"--seq-len {seq_len}: sequence parallelism over {sp} ranks needs a length it divides "
                             "(each rank holds an equal share of every sequence)")
    try:
        shares = tuple(stage_shares(model, pp)) if pp > 1 and tp == 1 else ()
        if sp > 1:
            check_ulysses_split(model, sp)
        per_example = trace_activations(model, 1, seq_len // sp, dtype=dtype, task=task, tp=tp)
        if pp > 1 and tp > 1:  # stages of the split model: each stage's tensor-parallel shard
            shares = tuple(stage_shares(model, pp))
    except (TypeError, ValueError) as error:  # the layout does not fit the model (no TP plan, no pipeline layers,
        # a factory model whose forward takes no input_ids / labels): say so in one line
        raise PlanModelError(f"{type(model).__name__} cannot be planned this way: {str(error).splitlines()[0]} "
                             "(the trace calls model(input_ids=..., labels=...))") from None
    trainable, frozen = parameter_counts(model)  # after the trace: this rank's shards (ties kept)
    return ModelProfile(trainable, frozen, largest_unit_params(model), per_example, seq_len // sp,
                        2 if precision in ("bf16", "fp16") else 4, shares, *_embedding_params(model))


def _embedding_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters only looked up, the input embedding's parameters): the first is the second when no output
    layer multiplies by the embedding (untied), else 0."""
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return 0, 0
    output = get_output() if callable(get_output) else None
    return (0 if getattr(output, "weight", None) is weight else weight.numel()), weight.numel()


def plan_rank(model: torch.nn.Module, layout: Layout, seq_len: int, task: str = "causal-lm") -> RankPlan:
    """Per-rank memory of training ``model`` (on the meta device; consumed by the activation trace) with
    ``layout`` at ``seq_len`` tokens."""
    return plan_from_profile(profile_model(model, seq_len, layout.precision, task, layout.tp, layout.pp, layout.sp),
                             layout)


def stage_profiles(profile: ModelProfile, layout: Layout) -> list[ModelProfile]:
    """What one rank of each pipeline stage multiplies and runs: its stage's parameters (the input embedding
    only looked up, on the first stage) and blocks (``stages`` = that stage's share); the whole profile when
    not pipelined. The stages' memory differs from their compute (the head stage's logits, the first
    stage's lookup), so the fullest stage sets the memory and the slowest the time."""
    if layout.pp == 1 or not profile.stages:
        return [profile]
    return [dataclasses.replace(profile, trainable=share.trainable, frozen=share.frozen, stages=(share,),
                                lookup=profile.embedding if share.index == 0 else 0) for share in profile.stages]


def plan_from_profile(profile: ModelProfile, layout: Layout) -> RankPlan:
    """Per-rank memory of ``layout`` for a profiled model (pure arithmetic: the auto layout calls it per
    candidate); with pipeline stages, the fullest stage's rank."""
    if layout.pp > 1 and profile.stages:
        plans = []
        for held in stage_profiles(profile, layout):
            share = held.stages[0]
            narrowed = dataclasses.replace(held, stages=(), per_example=stage_activations(
                profile.per_example, share, in_flight(share.index, layout.pp, layout.gas)))
            plan = plan_from_profile(narrowed, dataclasses.replace(layout, pp=1))
            plan.stage = share.index
            plans.append(plan)
        return max(plans, key=lambda plan: plan.total("device"))
    trainable, frozen = profile.trainable, profile.frozen
    states = zerotune_model_states(trainable, frozen, stage=layout.stage, dp=layout.zero_group,
                                   precision=layout.precision, optimizer=layout.optimizer,
                                   offload_optimizer=layout.offload_optimizer, offload_param=layout.offload_param)
    width = profile.width
    micro = layout.micro_batch
    activations = profile.per_example.scaled(micro)
    plan = RankPlan(trainable=trainable, frozen=frozen, lookup=profile.lookup, activations=activations)
    rows = plan.rows
    rows.append(Row("parameters", states.params, note=f"{trainable + frozen:,} x {width} B"
                    + (f" / {layout.zero_group}" if layout.stage == 3 else "")))
    rows.append(Row("gradients", states.grads, note="fp32 all-reduce buckets" if layout.stage == 0 else ""))
    rows.append(Row("fp32 master weights", states.master_weights))
    rows.append(Row("optimizer state", states.optimizer_state, note=layout.optimizer))
    rows.append(Row("communication buckets", _bucket_bytes(layout, trainable + frozen, trainable, width)))
    rows.append(Row("activations (no checkpointing)", activations.saved_bytes,
                    note=f"micro-batch {micro} x {profile.seq_len} tokens"
                         + (f" (1/{layout.sp} of each sequence)" if layout.sp > 1 else "")))
    rows.append(Row("activations (checkpointing every block)", activations.checkpointed_bytes,
                    note=f"{len(activations.block_saved)} blocks"))
    if layout.stage == 3:
        rows.append(Row("largest unit gathered", width * profile.largest_unit, note="stage 3 all-gather"))
    if activations.logits_bytes:  # the loss runs in fp32 whatever the precision: two fp32 gradient buffers at once
        tokens_x_vocab = activations.logits_bytes // width
        rows.append(Row("loss logits peak", tokens_x_vocab * 8, note="fp32 gradients of log-softmax and logits"))
    if states.host:
        rows.append(Row("offloaded state (host)", states.host, where="host"))
    if states.nvme:
        rows.append(Row("offloaded state (NVMe)", states.nvme, where="nvme"))
    return plan


def _bucket_bytes(layout: Layout, params: int, trainable: int, width: int) -> int:
    if layout.stage == 2:  # buckets are cut at every owner's slice boundary: none spans two ranks' slices
        per_owner = -(-trainable // layout.zero_group)
        bucket = min(layout.reduce_bucket, per_owner)
        count = layout.zero_group * -(-per_owner // bucket)
        overlap = layout.overlap_comm if layout.overlap_comm is not None else False  # stage 2's default: off
        return min(IN_FLIGHT_BUCKETS if overlap else 1, count) * width * bucket
    if layout.stage == 3:
        return width * (min(layout.prefetch_bucket, params) + min(layout.reduce_bucket, trainable))
    return 0
