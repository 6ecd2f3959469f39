"""The phases ``zerotune.initialize`` runs, top to bottom, each returning one typed piece of the assembly.

``configure_run`` (config, distributed env, mesh, resolved config, precision) -> ``check_run`` (what does not
compose, the notes) -> ``place_model`` (checkpointed blocks, device, rank 0's weights, pipeline / tensor /
sequence parallel split) -> ``build_stage`` (parameter groups, the ZeRO stage) -> ``build_training``
(optimizer on the stage's masters, LR scaling, LR schedule, loss scaler) -> ``assemble_engine``. Each phase
takes the pieces before it, never the user's arguments wholesale, so what a phase may change is visible in
its signature; the model the user passed goes in once (``place_model``) and the placed model goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerotune.config import (
    ConfigError,
    NotSupportedYetError,
    assert_implemented,
    load_config,
    resolve_config,
    resolved,
)
from zerotune.config.schema import ZeroTuneConfig
from zerotune.curriculum.data_sampling import DataCurriculum
from zerotune.distributed import comm
from zerotune.distributed.compression import TopKCompressor
from zerotune.distributed.engine_guards import EngineGuards
from zerotune.distributed.env import DistEnv, init_distributed
from zerotune.distributed.mesh import ProcessMesh, build_mesh
from zerotune.engine import Engine
from zerotune.engine_curriculum import curriculum_notes
from zerotune.engine_data import build_dataloader
from zerotune.initialize_parallel import (
    check_model_parallel_composes,
    install_sequence_parallel,
    model_parallel_norm,
    parallel_dims,
    split_tensor_parallel,
)
from zerotune.monitor.logging import log_rank0
from zerotune.optim import (
    Lamb,
    apply_lr_scaling,
    build_optimizer,
    build_scheduler,
    optimizer_defaults,
    scale_schedule_lrs,
)
from zerotune.optim.onebit_adam import OneBitAdam
from zerotune.parallel.block_checkpointing import checkpoint_blocks_at_initialize
from zerotune.parallel.tensor.layout import tp_layout_of
from zerotune.pipe.engine import PipelineEngine
from zerotune.pipe.module import PipelineModule
from zerotune.pipe.setup import build_pipeline, check_pipeline_composes
from zerotune.plan.auto import choose_stage_at_initialize
from zerotune.plan.measure import measure as measure_hardware
from zerotune.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from zerotune.precision.policy import PrecisionPolicy, policy_from_flags
from zerotune.zero.build import build_zero_state, gradient_compressor
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.stage3.sharded_param import sharded_param_of

IMPLEMENTED_ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class RunSetup:
    """The resolved config and where this process sits: what every later phase reads."""

    raw: Any
    """The config as loaded ("auto" values unresolved): what ranks compare at the start."""
    cfg: ZeroTuneConfig
    env: DistEnv
    mesh: ProcessMesh
    policy: PrecisionPolicy
    pipelined: bool


@dataclass
class PlacedModel:
    """The model on its device, split for this rank (a pipeline stage, tensor-parallel shards)."""

    module: torch.nn.Module
    split_from: torch.nn.Module
    """The model the user passed (``module`` itself unless a pipeline cut it into stages)."""
    tie_groups: dict
    batch_fn: Callable | None


@dataclass
class StagePiece:
    """The ZeRO stage over the trainable parameters and the user's parameter groups."""

    state: ZeroStage
    groups: list[dict]
    compressor: TopKCompressor | None


@dataclass
class Training:
    """What steps the masters: the optimizer, its LR schedule and the loss scaler."""

    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    loss_scaler: StaticLossScaler | DynamicLossScaler


def configure_run(source: Any, model: torch.nn.Module, *, dist_init_required: bool | None,
                  distributed_port: int) -> RunSetup:
    """Load the config, join the process group, build the mesh and resolve the config for it (batch triple,
    "auto" values from the model, ``zero_optimization.stage: auto`` from the plan)."""
    raw = load_config(source)
    env = init_distributed(dist_init_required=dist_init_required, distributed_port=distributed_port)
    mesh = build_mesh(parallel_dims(raw, env.world_size, model), env.device.type)
    auto_values = _auto_values(raw, model)
    if raw.zero_optimization.stage == "auto":  # the plan's choice (zerotune/plan/auto.py), logged with its reason
        dtype = torch.bfloat16 if raw.bf16.enabled else torch.float16 if raw.fp16.enabled else torch.float32
        measured = measure_hardware(mesh.group("dp_sp"), mesh.size("dp") * mesh.size("sp"), env.device, dtype)
        choice = choose_stage_at_initialize(model, raw, mesh.size("dp"), env.device, measured,
                                            tp=mesh.size("tp"), pp=mesh.size("pp"), sp=mesh.size("sp"))
        auto_values["zero_optimization.stage"] = choice.best.layout.stage
        log_rank0("zero_optimization.stage auto (%s; activations not counted: initialize does not know the "
                  "sequence length, zerotune plan --seq-len does):\n%s", measured.describe(), choice.explain(),
                  rank=env.rank)
    cfg = resolve_config(raw, dp_world_size=mesh.size("dp"), auto_values=auto_values)
    assert_implemented(cfg, zero_stages=IMPLEMENTED_ZERO_STAGES)
    policy = policy_from_flags(fp16=resolved(cfg.fp16.enabled, "fp16.enabled"),
                               bf16=resolved(cfg.bf16.enabled, "bf16.enabled"))
    pipelined = isinstance(model, PipelineModule) or mesh.size("pp") > 1
    return RunSetup(raw, cfg, env, mesh, policy, pipelined)


def check_run(setup: RunSetup, *, has_training_data: bool) -> None:
    """Log the config's notes; refuse what does not compose (before anything is built)."""
    cfg, rank = setup.cfg, setup.env.rank
    for path, message in cfg.notes:
        log_rank0("config %s: %s", path, message, rank=rank)
    check_model_parallel_composes(cfg, setup.mesh)
    check_pipeline_composes(cfg, setup.mesh)
    for note in curriculum_notes(cfg, pipelined=setup.pipelined, has_training_data=has_training_data):
        log_rank0("%s", note, rank=rank, level=logging.WARNING)
    if cfg.flops_profiler.enabled and setup.pipelined:
        raise NotSupportedYetError("flops_profiler.enabled", "the flops profiler runs in the engine's forward, which a "
                                                             "pipeline's stages do not use; profile the model with "
                                                             "deepspeed.profiling.flops_profiler.get_model_profile")
    if cfg.compile.enabled and (setup.pipelined or cfg.zero_optimization.stage == 3):
        raise NotSupportedYetError("compile.enabled", "torch.compile of a pipeline's stages or of a ZeRO stage-3 model "
                                                      "is not supported yet (engine.compile says why); compile at "
                                                      "stages 0-2 without a pipeline")


def place_model(setup: RunSetup, model: torch.nn.Module, guards: EngineGuards) -> PlacedModel:
    """Checkpointed blocks where the model declares them (following ``guards``' policy), then the model on its
    device with rank 0's weights, cut into this rank's pipeline stage and split over tp / sp."""
    cfg, env, mesh = setup.cfg, setup.env, setup.mesh
    if "activation_checkpointing" in setup.raw.model_fields_set:  # (checkpoint_blocks_at_initialize says why)
        _, outcome = checkpoint_blocks_at_initialize(model, cfg.activation_checkpointing.wrap_blocks, engine=guards)
        log_rank0("activation checkpointing: %s", outcome, rank=env.rank)
    cut_here = setup.pipelined and not isinstance(model, PipelineModule)  # an HF model every rank built whole
    if not cut_here:  # (one to cut stays on the host until then: only this rank's stage goes to the device)
        model.to(env.device)
    if not setup.pipelined:
        broadcast_from_rank0(model, shard_group=mesh.group("dp_sp"))  # (the ranks holding the same tp shard)
        split_tensor_parallel(model, cfg, mesh, rank=env.rank)
        install_sequence_parallel(model, mesh, rank=env.rank)
        return PlacedModel(model, model, {}, None)
    if cut_here:
        broadcast_from_rank0(model, staging=env.device)
    stage_module, tie_groups, batch_fn = build_pipeline(
        model, cfg, mesh, split_tensor_parallel=lambda m: split_tensor_parallel(m, cfg, mesh, rank=env.rank))
    stage_module.to(env.device)
    log_rank0("pipeline: %s; schedule %s", stage_module.describe_stages(), cfg.pipeline.schedule, rank=env.rank)
    return PlacedModel(stage_module, model, tie_groups, batch_fn)


def build_stage(setup: RunSetup, placed: PlacedModel, client_optimizer: Any, model_parameters: Any) -> StagePiece:
    """The user's parameter groups (of this rank's stage) and the ZeRO stage over their trainable parameters."""
    model, rank = placed.module, setup.env.rank
    groups = _param_groups(model, client_optimizer, model_parameters)
    if model is not placed.split_from:  # an HF model's parameters of other pipeline stages live elsewhere
        local = {id(p) for p in model.parameters()}
        groups = [{**g, "params": [p for p in g["params"] if id(p) in local]} for g in groups]
    trainable = _trainable_in_model_order(model, groups)
    chosen = {id(t) for t in trainable}
    omitted = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    if omitted:
        log_rank0("%d parameter(s) require grad but are in no optimizer group and will not be trained (e.g. %s); "
                  "set requires_grad=False to save their gradient memory", len(omitted), omitted[0], rank=rank)
    compressor = gradient_compressor(setup.cfg)
    state = build_zero_state(setup.cfg, groups, trainable, setup.policy, setup.mesh, model, compressor, rank=rank,
                             norm=model_parallel_norm(setup.mesh, model if isinstance(model, PipelineModule) else None))
    return StagePiece(state, groups, compressor)


def build_training(setup: RunSetup, stage: StagePiece, client_optimizer: Any, client_scheduler: Any) -> Training:
    """The optimizer over the stage's masters (what it cannot step refused), LR scaling, the LR schedule."""
    cfg, rank = setup.cfg, setup.env.rank
    optimizer = _build_optimizer(cfg.optimizer, client_optimizer, stage.state.optimizer_groups(stage.groups))
    if isinstance(optimizer, OneBitAdam):
        if stage.state.shards_masters or stage.compressor is not None:
            raise ConfigError("optimizer.type", "OneBitAdam needs ZeRO stage 0 and no gradient_compression block (it "
                                                "compresses the momentum itself; DeepSpeed's refuses ZeRO too)")
        optimizer.comm_group = setup.mesh.group("dp_sp")
    if isinstance(optimizer, Lamb) and stage.state.shards_masters:
        raise NotSupportedYetError("optimizer.type", "Lamb with ZeRO stages 1-3 is not supported yet: its "
                                                     "per-parameter trust ratios need whole parameters; use stage 0 "
                                                     "or Adam/AdamW")
    if cfg.lr_scaling is not None and optimizer is not None:
        factor = apply_lr_scaling(optimizer, cfg.lr_scaling.rule, resolved(cfg.train_batch_size, "train_batch_size"),
                                  resolved(cfg.lr_scaling.base_batch_size, "lr_scaling.base_batch_size"))
        log_rank0("lr_scaling: %s rule x%g (train_batch_size %d / base_batch_size %d), lr now %s",
                  cfg.lr_scaling.rule, factor, cfg.train_batch_size, cfg.lr_scaling.base_batch_size,
                  [g["lr"] for g in optimizer.param_groups], rank=rank)
        if cfg.scheduler is not None:  # absolute lrs in the schedule scale alike
            cfg.scheduler.params = scale_schedule_lrs(cfg.scheduler.params, factor)
    return Training(optimizer, _build_scheduler(cfg.scheduler, client_scheduler, optimizer), _loss_scaler(cfg))


def assemble_engine(setup: RunSetup, placed: PlacedModel, stage: StagePiece, training: Training, *,
                    training_data: Any, collate_fn: Callable | None, client_optimizer: Any,
                    guards: EngineGuards) -> Engine | PipelineEngine:
    """The engine over the pieces (a ``PipelineEngine`` for a pipelined model), with its data loader."""
    cfg, env, mesh = setup.cfg, setup.env, setup.mesh
    gas = resolved(cfg.gradient_accumulation_steps, "gradient_accumulation_steps")
    micro_batch = resolved(cfg.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu")
    curriculum = DataCurriculum.from_config(cfg.data_efficiency, gas, env.rank)
    core: dict[str, Any] = dict(  # EngineCore's keyword arguments
        module=placed.module, config=cfg, env=env, mesh=mesh, policy=setup.policy, state=stage.state,
        optimizer=training.optimizer, lr_scheduler=training.lr_scheduler, loss_scaler=training.loss_scaler,
        param_names={id(p): n for n, p in placed.module.named_parameters()},
        training_dataloader=build_dataloader(training_data, mesh, micro_batch, collate_fn,
                                             resolved(cfg.dataloader_drop_last, "dataloader_drop_last"), curriculum),
        compressor=stage.compressor, guards=guards,
        client_optimizer=client_optimizer if isinstance(client_optimizer, torch.optim.Optimizer) else None)
    if setup.pipelined:
        return PipelineEngine(tie_groups=placed.tie_groups, batch_fn=placed.batch_fn, **core)
    return Engine(**core)


def _auto_values(raw: Any, model: torch.nn.Module) -> dict[str, Any]:
    """Values for HF-style "auto" keys that initialize can derive from the model and optimizer."""
    values: dict[str, Any] = {}
    if raw.optimizer is not None:
        try:
            defaults = optimizer_defaults(raw.optimizer.type)
        except ValueError:
            defaults = {}
        values.update({f"optimizer.params.{key}": value for key, value in defaults.items()})
        lr = raw.optimizer.params.get("lr", "auto")
        lr = defaults.get("lr") if lr == "auto" else lr
        if isinstance(lr, (int, float)):
            values["scheduler.params.warmup_max_lr"] = lr
            values["scheduler.params.cycle_max_lr"] = lr
    values["scheduler.params.warmup_min_lr"] = 0.0
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        values["zero_optimization.reduce_bucket_size"] = hidden * hidden
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden
    return values


def _param_groups(model: torch.nn.Module, optimizer: Any, model_parameters: Any) -> list[dict]:
    """Parameter groups as dicts; ``model_parameters`` may be tensors or dicts with their own hyperparameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [dict(group) for group in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        return [{**item, "params": list(item["params"])} for item in items]
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    raise TypeError("model_parameters must be an iterable of parameters or of param-group dicts")


def _trainable_in_model_order(model: torch.nn.Module, groups: list[dict]) -> list[torch.nn.Parameter]:
    in_model = {id(p) for p in model.parameters()}
    chosen = {id(p) for group in groups for p in group["params"] if p.requires_grad}
    stray = chosen - in_model
    if stray:
        raise ValueError(f"{len(stray)} optimizer parameter(s) do not belong to the model passed to initialize()")
    return [p for p in model.parameters() if id(p) in chosen]


def broadcast_from_rank0(model: torch.nn.Module, staging: torch.device | None = None,
                         shard_group: torch.distributed.ProcessGroup | None = None) -> None:
    """Start every rank from rank 0's full weights and buffers (before tensor parallelism splits them).

    Parameters ``zero.Init`` partitioned were broadcast from rank 0 as they were built. Tensor-parallel shards a
    script made already differ by tp rank: each comes from the first rank of ``shard_group`` (the
    ranks holding the same shard; None: no other holder). ``staging``: a model kept on the host whose
    collectives need device tensors (NCCL) goes through that device one tensor at a time, so a model bigger
    than one device (cut into pipeline stages next) is never on it whole.
    """
    world = torch.distributed.group.WORLD
    through_device = staging is not None and torch.distributed.get_backend() == "nccl"
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if sharded_param_of(tensor) is not None:
                continue
            group = world if tp_layout_of(tensor) is None else shard_group
            if group is None:
                continue
            data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            if through_device and data.device != staging:
                staged = data.to(staging)
                comm.broadcast(staged, 0, group)
                data.copy_(staged)
            else:
                comm.broadcast(data, 0, group)


def _build_optimizer(raw_optimizer: Any, client: Any, master_groups: list[dict]) -> torch.optim.Optimizer | None:
    """The optimizer over the stage's master parameters (full masters at stage 0, flat shards at 1/2)."""
    if client is not None and raw_optimizer is not None:  # DeepSpeed uses the client's too
        log_rank0("initialize(optimizer=%s) and the config's 'optimizer' block (%s) were both given: using the "
                  "client optimizer; the config block has no effect", type(client).__name__, raw_optimizer.type,
                  rank=_global_rank(), level=logging.WARNING)
    if isinstance(client, torch.optim.Optimizer):
        if client.state:
            raise ValueError("the client optimizer already holds state; pass a fresh one (load state via "
                             "load_checkpoint)")
        for group, master_group in zip(client.param_groups, master_groups):
            group["params"] = master_group["params"]
        return client
    if callable(client):
        return client(master_groups)
    if raw_optimizer is not None:
        return build_optimizer(raw_optimizer.type, raw_optimizer.params, master_groups)
    return None


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _build_scheduler(raw_scheduler: Any, client: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    if client is not None and raw_scheduler is not None:  # as with the optimizer: the client's wins
        log_rank0("initialize(lr_scheduler=...) and the config's 'scheduler' block (%s) were both given: using the "
                  "client scheduler; the config block has no effect", raw_scheduler.type, rank=_global_rank(),
                  level=logging.WARNING)
        raw_scheduler = None
    if client is not None:
        return client if hasattr(client, "step") else client(optimizer)
    if raw_scheduler is not None:
        if optimizer is None:
            raise ConfigError("scheduler", "a scheduler needs an optimizer (config 'optimizer' block or optimizer=)")
        return build_scheduler(raw_scheduler.type, raw_scheduler.params, optimizer)
    return None


def _loss_scaler(cfg: Any) -> StaticLossScaler | DynamicLossScaler:
    fp16 = cfg.fp16
    if not fp16.enabled:
        return StaticLossScaler(1.0)
    if fp16.loss_scale > 0:
        return StaticLossScaler(float(fp16.loss_scale))
    return DynamicLossScaler.from_config(initial_scale_power=fp16.initial_scale_power,
                                         loss_scale_window=fp16.loss_scale_window, min_loss_scale=fp16.min_loss_scale,
                                         hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis)
