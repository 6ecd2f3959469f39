"""Save and load everything a run needs to continue bit-identically.

Layout of ``<save_dir>/<tag>/`` (written through ``checkpoint.atomic``):
* ``model_states.pt``   (rank 0) module state dict by parameter name, counters, loss scaler,
                        LR scheduler, client state, the config and the layout it was saved on;
* ``optim_states.pt``   (rank 0) optimizer state and fp32 master weights keyed by parameter
                        *name* (not by position), so a reader can match them to any layout;
* ``rng_state_rank{r}.pt`` (every rank) torch / CUDA / Python / NumPy generators, so dropout
                        and sampling continue as if never interrupted.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zerotune.checkpoint.atomic import (CheckpointError, partial_dir, prepare_partial_dir, publish, read_file,
                                        resolve_tag, write_file_atomically)
from zerotune.distributed import comm
from zerotune.monitor.logging import get_logger

if TYPE_CHECKING:
    from zerotune.engine import Engine

MODEL_FILE = "model_states.pt"
OPTIM_FILE = "optim_states.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank}.pt"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _optimizer_state_by_name(engine: Engine) -> dict:
    """The optimizer's state dict with parameter positions replaced by parameter names."""
    names = [engine.param_names[id(p)] for p in engine.masters.params]
    position_of_master = {id(engine.masters.master_of(p)): i for i, p in enumerate(engine.masters.params)}
    order = [names[position_of_master[id(m)]] for group in engine.optimizer.param_groups for m in group["params"]]
    raw = engine.optimizer.state_dict()
    state = {order[index]: value for index, value in raw["state"].items()}
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in raw["param_groups"]]
    masters = ({name: m.detach().clone() for name, m in zip(names, engine.masters.masters)}
               if engine.policy.mixed else {})
    return {"state": state, "param_groups": groups, "fp32_masters": masters}


def _load_optimizer_state_by_name(engine: Engine, saved: dict, path: Path) -> None:
    names = [engine.param_names[id(p)] for p in engine.masters.params]
    position_of_master = {id(engine.masters.master_of(p)): i for i, p in enumerate(engine.masters.params)}
    order = [names[position_of_master[id(m)]] for group in engine.optimizer.param_groups for m in group["params"]]
    saved_names = [n for group in saved["param_groups"] for n in group["params"]]
    if sorted(saved_names) != sorted(order):
        missing = sorted(set(order) - set(saved_names))[:3]
        extra = sorted(set(saved_names) - set(order))[:3]
        raise CheckpointError(f"optimizer state in {path} does not match this model's trainable parameters "
                              f"(missing: {missing}, unexpected: {extra})")
    index_of = {name: i for i, name in enumerate(order)}
    groups = [{**group, "params": [index_of[n] for n in group["params"]]} for group in saved["param_groups"]]
    state = {index_of[name]: value for name, value in saved["state"].items()}
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})
    if engine.policy.mixed:
        with torch.no_grad():
            for name, master in zip(names, engine.masters.masters):
                master.copy_(saved["fp32_masters"][name])


def save_engine_checkpoint(engine: Engine, save_dir: str, tag: str | None, client_state: dict,
                           save_latest: bool) -> None:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tags = comm.all_gather_object(tag, None if engine.world_size == 1 else torch.distributed.group.WORLD)
    if len(set(tags)) != 1:
        raise CheckpointError(f"ranks passed different checkpoint tags: {tags}")
    if engine.global_rank == 0:
        prepare_partial_dir(save_dir, tag)
    comm.barrier()
    staging = partial_dir(save_dir, tag)
    if engine.global_rank == 0:
        write_file_atomically({
            "module": engine.module.state_dict(),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "client_state": client_state, "config": engine.config,
            "layout": {"dp_world_size": engine.dp_world_size, "zero_stage": engine.zero_optimization_stage(),
                       "precision": engine.policy.name},
        }, staging / MODEL_FILE)
        write_file_atomically(_optimizer_state_by_name(engine), staging / OPTIM_FILE)
    write_file_atomically(_rng_state(), staging / rng_file(engine.global_rank))
    comm.barrier()
    if engine.global_rank == 0:
        final = publish(save_dir, tag, save_latest)
        get_logger().info("saved checkpoint %s", final)
    comm.barrier()


def load_engine_checkpoint(engine: Engine, load_dir: str, tag: str | None, *, load_module_strict: bool,
                           load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_only: bool) -> tuple[str | None, dict | None]:
    resolved = resolve_tag(load_dir, tag)
    if resolved is None:
        get_logger().warning("no 'latest' file in %s and no tag given: nothing loaded", load_dir)
        return None, None
    directory = Path(load_dir) / resolved
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    saved = read_file(directory / MODEL_FILE, "model states")
    try:
        engine.module.load_state_dict(saved["module"], strict=load_module_strict)
    except RuntimeError as error:
        raise CheckpointError(f"{directory / MODEL_FILE} does not fit this model: {error}") from error
    engine.masters.copy_from_model()
    if load_module_only:
        return str(directory), saved["client_state"]
    if load_optimizer_states and engine.optimizer is not None:
        _load_optimizer_state_by_name(engine, read_file(directory / OPTIM_FILE, "optimizer states"),
                                      directory / OPTIM_FILE)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    engine.loss_scaler.load_state_dict(saved["loss_scaler"])
    for counter in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        setattr(engine, counter, saved[counter])
    rng_path = directory / rng_file(engine.global_rank)
    if rng_path.is_file():
        _set_rng_state(read_file(rng_path, "RNG state"))
    else:
        get_logger().warning("%s not found (saved on %d data-parallel ranks): RNG state not restored",
                             rng_path, saved["layout"]["dp_world_size"])
    engine.zero_grad()
    return str(directory), saved["client_state"]
