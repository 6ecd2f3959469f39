"""``zerotune.initialize``: DeepSpeed's entry point, a short sequence of phases read top to bottom.

config -> distributed env -> mesh -> resolved config ("auto", batch triple) -> guards -> what does not
compose -> model on its device with rank 0's weights, split -> fp32 masters, model cast, gradient sync (the
ZeRO stage) -> optimizer (on the masters), LR scaling, LR scheduler -> dataloader -> Engine. The phases and
the typed pieces they return are in ``initialize_phases.py``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterable

import torch

from zerotune.config import ConfigError
from zerotune.distributed import comm
from zerotune.distributed.env import DEFAULT_PORT
from zerotune.distributed.guard import GUARD
from zerotune.distributed.mesh import AXES, DERIVED_AXES, ProcessMesh
from zerotune.distributed.watchdog import WATCHDOG
from zerotune.engine import Engine
from zerotune.initialize_phases import (assemble_engine, build_stage, build_training, check_run, configure_run,
                                        place_model)
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.activation_checkpointing import configure as configure_activation_checkpointing
from zerotune.pipe.module import PipelineModule



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


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = DEFAULT_PORT, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``. The phases
    are in ``initialize_phases.py``; each returns one typed piece of the assembly."""
    if model is None:
        raise ValueError("initialize() needs model=")
    if mpu is not None:
        raise ConfigError("mpu", "a Megatron mpu object is not supported: zerotune builds its own mesh from "
                                 "tensor_parallel.autotp_size and sequence_parallel_size")
    if mesh_param is not None:
        raise ConfigError("mesh_param", "is not supported: zerotune builds its mesh from tensor_parallel.autotp_size, "
                                        "sequence_parallel_size and pipeline.stages")
    setup = configure_run(_config_source(args, config, config_params), model, dist_init_required=dist_init_required,
                          distributed_port=distributed_port)
    cfg, env = setup.cfg, setup.env
    if cfg.comm_timeout_s is None:  # (process-wide: the latest engine's setting holds)
        WATCHDOG.stop()
    else:
        WATCHDOG.start(cfg.comm_timeout_s, rank=env.rank)
    _arm_collective_guard(cfg.collective_guard, setup.raw.model_dump(mode="json"), setup.mesh, model, env.rank)
    check_run(setup, has_training_data=training_data is not None)
    # The config is the source of truth for zerotune.checkpointing.checkpoint(...) calls and for blocks wrapped by
    # apply_activation_checkpointing(model) without an explicit policy (they read it at call time).
    configure_activation_checkpointing(deepspeed_config=cfg.activation_checkpointing)
    placed = place_model(setup, model)
    stage = build_stage(setup, placed, optimizer, model_parameters)
    training = build_training(setup, stage, optimizer, lr_scheduler)
    engine = assemble_engine(setup, placed, stage, training, training_data=training_data, collate_fn=collate_fn,
                             client_optimizer=optimizer)
    if cfg.compile.enabled:
        engine.compile(backend=cfg.compile.backend, compile_kwargs=cfg.compile.kwargs)
    if cfg.checkpoint.auto_resume:
        path, _ = engine.resume_newest_checkpoint()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log_rank0("checkpoint.auto_resume: %s (launcher restart %s)", f"resumed from {path} at step {engine.global_steps}"
                  if path else f"no checkpoint in {cfg.checkpoint.save_dir}, starting fresh", restart, rank=env.rank)
    mesh = setup.mesh
    log_rank0("zerotune engine: world %d (dp %d x sp %d x tp %d), ZeRO stage %d, %s, micro-batch %d x GAS %d = batch %d",
              env.world_size, mesh.size("dp"), mesh.size("sp"), mesh.size("tp"), cfg.zero_optimization.stage,
              setup.policy.name, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
              cfg.train_batch_size, rank=env.rank)
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
