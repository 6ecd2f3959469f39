"""``zerotune.initialize``: the one place that reads the whole config and wires the parts.

The order is fixed and visible:
config -> distributed env -> mesh -> resolved config ("auto", batch triple) -> model on its
device with rank 0's weights -> fp32 masters -> model cast to its dtype -> gradient sync
-> optimizer (on the masters) -> LR scaling -> LR scheduler -> dataloader -> Engine.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable, Iterable

import torch

from zerotune.config import ConfigError, NotSupportedYetError, assert_implemented, load_config, resolve_config
from zerotune.distributed import comm
from zerotune.distributed.env import DEFAULT_PORT, init_distributed
from zerotune.distributed.guard import GUARD
from zerotune.distributed.mesh import AXES, DERIVED_AXES, ProcessMesh, build_mesh
from zerotune.distributed.watchdog import WATCHDOG
from zerotune.curriculum.data_sampling import DataCurriculum
from zerotune.engine import Engine
from zerotune.engine_curriculum import curriculum_notes
from zerotune.engine_data import build_dataloader
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.activation_checkpointing import checkpoint_blocks_at_initialize
from zerotune.initialize_parallel import (check_model_parallel_composes, install_sequence_parallel,
                                          model_parallel_norm, parallel_dims, split_tensor_parallel)
from zerotune.pipe.engine import PipelineEngine
from zerotune.pipe.module import PipelineModule
from zerotune.pipe.setup import build_pipeline, check_pipeline_composes
from zerotune.parallel.activation_checkpointing import configure as configure_activation_checkpointing
from zerotune.optim.onebit_adam import OneBitAdam
from zerotune.optim import Lamb, apply_lr_scaling, build_optimizer, build_scheduler, optimizer_defaults, scale_schedule_lrs
from zerotune.plan.auto import choose_stage_at_initialize
from zerotune.plan.measure import measure as measure_hardware
from zerotune.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from zerotune.precision.policy import policy_from_flags
from zerotune.zero.build import build_zero_state, gradient_compressor
from zerotune.zero.stage3.sharded_param import sharded_param_of

IMPLEMENTED_ZERO_STAGES = (0, 1, 2, 3)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (and zerotune's own name for the config flag)."""
    group = parser.add_argument_group("zerotune", "zerotune / DeepSpeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", "--zerotune_config", dest="deepspeed_config", default=None, type=str,
                       help="path to the DeepSpeed-style JSON/YAML config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [source for source in (config, config_params) if source is not None]
    if config is not None and config_params is not None:
        raise ConfigError("", "pass the config once: both config= and config_params= were given")
    if from_args is not None and given:
        raise ConfigError("", f"two configs given: --deepspeed_config {from_args} and config= in initialize(); keep one")
    source = from_args if from_args is not None else (given[0] if given else None)
    if source is None:
        raise ConfigError("", "no config: pass config= (dict or JSON/YAML path) or args with --deepspeed_config")
    return source


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


def _broadcast_from_rank0(model: torch.nn.Module, staging: torch.device | None = None) -> None:
    """Start every rank from rank 0's full weights and buffers (before tensor parallelism splits them).

    Parameters ``zero.Init`` partitioned were broadcast from rank 0 as they were built. ``staging``: a model
    kept on the host whose collectives need device tensors (NCCL) goes through that device one tensor at a
    time, so a model bigger than one device (cut into pipeline stages next) is never on it whole.
    """
    group = torch.distributed.group.WORLD
    through_device = staging is not None and torch.distributed.get_backend() == "nccl"
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if sharded_param_of(tensor) is not None:
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
            raise ValueError("the client optimizer already holds state; pass a fresh one (load state via load_checkpoint)")
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


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = DEFAULT_PORT, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if model is None:
        raise ValueError("initialize() needs model=")
    if mpu is not None:
        raise ConfigError("mpu", "a Megatron mpu object is not supported: zerotune builds its own mesh from "
                                 "tensor_parallel.autotp_size and sequence_parallel_size")
    if mesh_param is not None:
        raise ConfigError("mesh_param", "is not supported: zerotune builds its mesh from tensor_parallel.autotp_size, "
                                        "sequence_parallel_size and pipeline.stages")
    raw = load_config(_config_source(args, config, config_params))
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
    if cfg.comm_timeout_s is None:  # (process-wide: the latest engine's setting holds)
        WATCHDOG.stop()
    else:
        WATCHDOG.start(cfg.comm_timeout_s, rank=env.rank)
    _arm_collective_guard(cfg.collective_guard, raw.model_dump(mode="json"), mesh, model, env.rank)
    for path, message in cfg.notes:
        log_rank0("config %s: %s", path, message, rank=env.rank)
    check_model_parallel_composes(cfg, mesh)
    check_pipeline_composes(cfg, mesh)
    # The config is the source of truth for zerotune.checkpointing.checkpoint(...) calls and for blocks wrapped by
    # apply_activation_checkpointing(model) without an explicit policy (they read it at call time). The block wraps
    # the model's own blocks only where it declares them (checkpoint_blocks_at_initialize says why).
    configure_activation_checkpointing(deepspeed_config=cfg.activation_checkpointing)
    if "activation_checkpointing" in raw.model_fields_set:
        _, outcome = checkpoint_blocks_at_initialize(model, cfg.activation_checkpointing.wrap_blocks)
        log_rank0("activation checkpointing: %s", outcome, rank=env.rank)
    policy = policy_from_flags(fp16=cfg.fp16.enabled, bf16=cfg.bf16.enabled)

    pipelined = isinstance(model, PipelineModule) or mesh.size("pp") > 1
    for note in curriculum_notes(cfg, pipelined=pipelined, has_training_data=training_data is not None):
        log_rank0("%s", note, rank=env.rank, level=logging.WARNING)
    if cfg.compile.enabled and (pipelined or cfg.zero_optimization.stage == 3):
        raise NotSupportedYetError("compile.enabled", "torch.compile of a pipeline's stages or of a ZeRO stage-3 model "
                                                      "is not supported yet (engine.compile says why); compile at "
                                                      "stages 0-2 without a pipeline")
    cut_here = pipelined and not isinstance(model, PipelineModule)  # an HF model every rank built whole
    if not cut_here:  # (one to cut stays on the host until then: only this rank's stage goes to the device)
        model.to(env.device)
    tie_groups, batch_fn, user_model = {}, None, model
    if pipelined:
        if cut_here:
            _broadcast_from_rank0(model, staging=env.device)
        model, tie_groups, batch_fn = build_pipeline(
            model, cfg, mesh, split_tensor_parallel=lambda m: split_tensor_parallel(m, cfg, mesh, rank=env.rank))
        model.to(env.device)
        log_rank0("pipeline: %s; schedule %s", model.describe_stages(), cfg.pipeline.schedule, rank=env.rank)
    else:
        _broadcast_from_rank0(model)
        split_tensor_parallel(model, cfg, mesh, rank=env.rank)
        install_sequence_parallel(model, mesh, rank=env.rank)
    groups = _param_groups(model, optimizer, model_parameters)
    if pipelined and model is not user_model:  # an HF model's parameters of other stages live elsewhere
        local = {id(p) for p in model.parameters()}
        groups = [{**g, "params": [p for p in g["params"] if id(p) in local]} for g in groups]
    trainable = _trainable_in_model_order(model, groups)
    omitted = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in {id(t) for t in trainable}]
    if omitted:
        log_rank0("%d parameter(s) require grad but are in no optimizer group and will not be trained (e.g. %s); "
                  "set requires_grad=False to save their gradient memory", len(omitted), omitted[0], rank=env.rank)
    compressor = gradient_compressor(cfg)
    state = build_zero_state(cfg, groups, trainable, policy, mesh, model, compressor, rank=env.rank,
                             norm=model_parallel_norm(mesh, model if pipelined else None))
    torch_optimizer = _build_optimizer(cfg.optimizer, optimizer, state.optimizer_groups(groups))
    if isinstance(torch_optimizer, OneBitAdam):
        if state.shards_masters or compressor is not None:
            raise ConfigError("optimizer.type", "OneBitAdam needs ZeRO stage 0 and no gradient_compression block (it "
                                                "compresses the momentum itself; DeepSpeed's refuses ZeRO too)")
        torch_optimizer.comm_group = mesh.group("dp_sp")
    if isinstance(torch_optimizer, Lamb) and state.shards_masters:
        raise NotSupportedYetError("optimizer.type", "Lamb with ZeRO stages 1-3 is not supported yet: its per-parameter "
                                                     "trust ratios need whole parameters; use stage 0 or Adam/AdamW")
    if cfg.lr_scaling is not None and torch_optimizer is not None:
        factor = apply_lr_scaling(torch_optimizer, cfg.lr_scaling.rule, cfg.train_batch_size,
                                  cfg.lr_scaling.base_batch_size)
        log_rank0("lr_scaling: %s rule x%g (train_batch_size %d / base_batch_size %d), lr now %s",
                  cfg.lr_scaling.rule, factor, cfg.train_batch_size, cfg.lr_scaling.base_batch_size,
                  [g["lr"] for g in torch_optimizer.param_groups], rank=env.rank)
        if cfg.scheduler is not None:  # absolute lrs in the schedule scale alike
            cfg.scheduler.params = scale_schedule_lrs(cfg.scheduler.params, factor)
    scheduler = _build_scheduler(cfg.scheduler, lr_scheduler, torch_optimizer)
    engine_class, extra = (PipelineEngine, {"tie_groups": tie_groups, "batch_fn": batch_fn}) if pipelined else (Engine, {})
    engine = engine_class(**extra, module=model, config=cfg, env=env, mesh=mesh, policy=policy, state=state,
                    optimizer=torch_optimizer, lr_scheduler=scheduler,
                    loss_scaler=_loss_scaler(cfg), param_names={id(p): n for n, p in model.named_parameters()},
                    training_dataloader=build_dataloader(training_data, mesh, cfg.train_micro_batch_size_per_gpu,
                                                          collate_fn, cfg.dataloader_drop_last, DataCurriculum.from_config(
                                                              cfg.data_efficiency, cfg.gradient_accumulation_steps,
                                                              env.rank)),
                    compressor=compressor,
                    client_optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None)
    if cfg.compile.enabled:
        engine.compile(backend=cfg.compile.backend, compile_kwargs=cfg.compile.kwargs)
    if cfg.checkpoint.auto_resume:
        path, _ = engine.resume_newest_checkpoint()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log_rank0("checkpoint.auto_resume: %s (launcher restart %s)", f"resumed from {path} at step {engine.global_steps}"
                  if path else f"no checkpoint in {cfg.checkpoint.save_dir}, starting fresh", restart, rank=env.rank)
    log_rank0("zerotune engine: world %d (dp %d x sp %d x tp %d), ZeRO stage %d, %s, micro-batch %d x GAS %d = batch %d",
              env.world_size, mesh.size("dp"), mesh.size("sp"), mesh.size("tp"), cfg.zero_optimization.stage, policy.name,
              cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size, rank=env.rank)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _arm_collective_guard(enabled: bool, config: dict, mesh: ProcessMesh, model: torch.nn.Module, rank: int) -> None:
    """Start the collective guard (process-wide, like the watchdog: the latest engine's setting holds) and
    compare every rank's config and model before the first collective that depends on them."""
    if not enabled:
        GUARD.stop()
        return
    GUARD.start([mesh.group(axis) for axis in (*AXES, *DERIVED_AXES)], rank=rank, store=_rendezvous_store())
    signature = [f"{name} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}" for name, p in model.named_parameters()]
    if isinstance(model, PipelineModule):  # a stage's ranks hold the same layers
        dp_sp = mesh.group("dp_sp")
        peers = torch.distributed.get_process_group_ranks(dp_sp) if dp_sp is not None else [rank]
    else:
        peers = list(range(torch.distributed.get_world_size()))
    comm.check_same_setup(config, signature, tuple(peers))


def _rendezvous_store() -> torch.distributed.Store | None:
    """The default group's store (stalled ranks compare notes there); None where torch hides it."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: without it, stalls wait for the watchdog
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
