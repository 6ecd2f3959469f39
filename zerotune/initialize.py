"""``zerotune.initialize``: DeepSpeed's entry point, a short sequence of phases read top to bottom.

config -> distributed env -> mesh -> resolved config ("auto", batch triple) -> guards -> what does not
compose -> model on its device with rank 0's weights, split -> fp32 masters, model cast, gradient sync (the
ZeRO stage) -> optimizer (on the masters), LR scaling, LR scheduler -> dataloader -> Engine. The phases and
the typed pieces they return are in ``initialize_phases.py``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch

from zerotune.config import ConfigError, resolved
from zerotune.distributed.engine_guards import EngineGuards
from zerotune.distributed.env import DEFAULT_PORT
from zerotune.engine import Engine
from zerotune.initialize_parallel import check_mpu_agrees
from zerotune.initialize_phases import (
    assemble_engine,
    build_stage,
    build_training,
    check_run,
    configure_run,
    place_model,
)
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.activation_checkpointing import policy_from_section
from zerotune.pipe.engine import PipelineEngine
from zerotune.pipe.module import PipelineModule


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [source for source in (config, config_params) if source is not None]
    if config is not None and config_params is not None:
        raise ConfigError("", "pass the config once: both config= and config_params= were given")
    if from_args is not None and given:
        raise ConfigError("", f"two configs given: --deepspeed_config {from_args} and config= in initialize(); "
                              "keep one")
    source = from_args if from_args is not None else (given[0] if given else None)
    if source is None:
        raise ConfigError("", "no config: pass config= (dict or JSON/YAML path) or args with --deepspeed_config")
    return source


class MissingModelError(ValueError, AssertionError):
    """``initialize`` without a model. Also an ``AssertionError``: DeepSpeed's check is an assert, so code written
    against DeepSpeed catches that."""


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = DEFAULT_PORT, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[Engine | PipelineEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``. The phases
    are in ``initialize_phases.py``; each returns one typed piece of the assembly."""
    if model is None:
        hint = " (a module was passed as the first argument, args=)" if isinstance(args, torch.nn.Module) else ""
        raise MissingModelError(f"initialize() needs model=, a torch.nn.Module; got None{hint}")
    if mesh_param is not None:
        raise ConfigError("mesh_param", "is not supported: zerotune builds its mesh from tensor_parallel.autotp_size, "
                                        "sequence_parallel_size and pipeline.stages")
    setup = configure_run(_config_source(args, config, config_params), model, dist_init_required=dist_init_required,
                          distributed_port=distributed_port)
    cfg, env = setup.cfg, setup.env
    check_mpu_agrees(mpu, setup.mesh)
    # This engine's own guards (distributed/engine_guards.py): its collective guard, its watchdog timeout, and
    # the activation-checkpointing policy its checkpoint(...) calls and wrapped blocks follow.
    comm_timeout_s = None if cfg.comm_timeout_s is None else resolved(cfg.comm_timeout_s, "comm_timeout_s")
    guards = EngineGuards.start(collective_guard=resolved(cfg.collective_guard, "collective_guard"),
                                comm_timeout_s=comm_timeout_s,
                                checkpoint_policy=policy_from_section(cfg.activation_checkpointing),
                                config=setup.raw.model_dump(mode="json"), mesh=setup.mesh, model=model, rank=env.rank,
                                stage_local=isinstance(model, PipelineModule))
    check_run(setup, has_training_data=training_data is not None)
    placed = place_model(setup, model, guards)
    stage = build_stage(setup, placed, optimizer, model_parameters)
    training = build_training(setup, stage, optimizer, lr_scheduler)
    engine = assemble_engine(setup, placed, stage, training, training_data=training_data, collate_fn=collate_fn,
                             client_optimizer=optimizer, guards=guards)
    if cfg.compile.enabled:
        engine.compile(backend=cfg.compile.backend, compile_kwargs=cfg.compile.kwargs)
    if cfg.checkpoint.auto_resume:
        path, _ = engine.resume_newest_checkpoint()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        outcome = (f"resumed from {path} at step {engine.global_steps}" if path
                   else f"no checkpoint in {cfg.checkpoint.save_dir}, starting fresh")
        log_rank0("checkpoint.auto_resume: %s (launcher restart %s)", outcome, restart, rank=env.rank)
    mesh = setup.mesh
    log_rank0("zerotune engine: world %d (dp %d x sp %d x tp %d), ZeRO stage %d, %s, "
              "micro-batch %d x GAS %d = batch %d", env.world_size, mesh.size("dp"), mesh.size("sp"),
              mesh.size("tp"), cfg.zero_optimization.stage, setup.policy.name,
              cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size,
              rank=env.rank)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
