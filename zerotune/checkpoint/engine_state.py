"""Save and load everything a run needs to continue bit-identically.

Layout of ``<save_dir>/<tag>/`` (written through ``checkpoint.atomic``):
* ``model_states.pt``   (rank 0) module state dict by parameter name (tensor-parallel shards joined
                        into full tensors, so it loads at any tp size), counters, loss scaler,
                        LR scheduler, client state, the config and the layout it was saved on;
* ``optim_states.pt``   (rank 0, ZeRO stage 0) optimizer state and fp32 master weights keyed by
                        parameter *name* (not by position), so a reader can match them to any layout;
                        with tensor parallelism one ``optim_states_tp_rank{t}.pt`` per tp rank;
* ``optim_states_rank{r}.pt`` (every rank, ZeRO stages 1-2) that rank's optimizer shard, with
                        the parameter ranges it holds: per group, the (name, numel, offset) of
                        every parameter in the flat layout and the rank's [start, end) slice;
* ``param_shards_rank{r}.pt`` (every rank, ZeRO stage 3) that rank's parameter shards per unit
                        (``model_states.pt`` then holds only what is not partitioned: buffers);
* ``compression_rank{r}.pt`` (every rank, with ``gradient_compression`` or OneBitAdam) the error-feedback
                        state: Top-K residuals, OneBitAdam's worker / server errors and step count;
* ``rng_state_rank{r}.pt`` (every rank) torch / CUDA / Python / NumPy generators, so dropout
                        and sampling continue as if never interrupted.
"""

from __future__ import annotations

import logging

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from zerotune.checkpoint.atomic import (CheckpointError, check_tag, describe_files, partial_dir, prepare_partial_dir, publish,
                                        read_file, read_manifest, resolve_tag, retain_newest, tag_directory, verify_files,
                                        write_file_atomically, write_manifest)
from zerotune.distributed import comm
from zerotune.monitor.logging import get_logger, log_rank0
from zerotune.parallel.tensor.state_dict import iter_full_tensors, shard_state_dict
from zerotune.zero.stage3.sharded_param import sharded_param_of

if TYPE_CHECKING:
    from zerotune.engine import Engine

MODEL_FILE = "model_states.pt"
OPTIM_FILE = "optim_states.pt"


def _stage_part(engine: Engine) -> str:
    return "" if engine.mesh.size("pp") == 1 else f"_stage{engine.mesh.rank('pp')}"


def model_file(engine: Engine) -> str:
    """One module file, or one per pipeline stage (each holds its own layers)."""
    return f"model_states{_stage_part(engine)}.pt"


def optim_file(engine: Engine) -> str:
    """Stage 0: one optimizer file, or one per pipeline stage and tensor-parallel rank (different parameters)."""
    tp = "" if engine.mesh.size("tp") == 1 else f"_tp_rank{engine.mesh.rank('tp')}"
    return f"optim_states{_stage_part(engine)}{tp}.pt"


def compression_file(rank: int) -> str:
    return f"compression_rank{rank}.pt"


def _compression_state(engine: Engine) -> dict:
    """This rank's error-feedback state: Top-K residuals and OneBitAdam's worker / server errors."""
    state = {}
    if engine.compressor is not None:
        state["topk"] = engine.compressor.state_dict()
    if hasattr(engine.optimizer, "error_state_dict"):
        state["onebit"] = engine.optimizer.error_state_dict()
    return state


def _load_compression_state(engine: Engine, saved: dict) -> None:
    if engine.compressor is not None and "topk" in saved:
        engine.compressor.load_state_dict(saved["topk"], engine.device)
    if hasattr(engine.optimizer, "load_error_state_dict") and "onebit" in saved:
        engine.optimizer.load_error_state_dict(saved["onebit"], engine.device)
        engine.grad_sync.local_only = engine.optimizer.takes_local_gradients


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank}.pt"


def _rng_state() -> dict:
    """Every generator, as tensors, numbers and tuples only (so it loads with ``weights_only``)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def optim_shard_file(rank: int) -> str:
    return f"optim_states_rank{rank}.pt"


def _position_names(engine: Engine) -> list[str]:
    """Parameter names in the order of the optimizer's (master) parameters."""
    weights = engine.state.weights
    name_of_master = {id(weights.master_of(p)): engine.param_names[id(p)] for p in engine.state.params}
    return [name_of_master[id(m)] for group in engine.optimizer.param_groups for m in group["params"]]


def _optimizer_state_by_name(engine: Engine) -> dict:
    """Stage 0: the optimizer's state dict with parameter positions replaced by parameter names."""
    order = _position_names(engine)
    raw = engine.optimizer.state_dict()
    state = {order[index]: value for index, value in raw["state"].items()}
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in raw["param_groups"]]
    masters = ({engine.param_names[id(p)]: engine.state.weights.master_of(p).detach().clone()
                for p in engine.state.params} if engine.policy.mixed else {})
    return {"state": state, "param_groups": groups, "fp32_masters": masters}


def _load_optimizer_state_by_name(engine: Engine, saved: dict, module_state: dict) -> None:
    """Stage 0 (names checked by ``_read_and_check``). The fp32 masters come from the checkpoint's masters,
    or, for a checkpoint saved in fp32, from its weights (exact): an fp32 checkpoint resumes in bf16/fp16."""
    order = _position_names(engine)
    index_of = {name: i for i, name in enumerate(order)}
    groups = [{**group, "params": [index_of[n] for n in group["params"]]} for group in saved["param_groups"]]
    state = {index_of[name]: value for name, value in saved["state"].items()}
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})
    masters = saved["fp32_masters"] or (module_state if engine.policy.mixed else {})
    with torch.no_grad():
        for p in engine.state.params:
            name = engine.param_names[id(p)]
            if name in masters:
                engine.state.weights.master_of(p).copy_(masters[name])


def param_shard_file(rank: int) -> str:
    return f"param_shards_rank{rank}.pt"


def _units(engine: Engine) -> list | None:
    """The stage-3 units (None below stage 3)."""
    return getattr(engine.state, "units", None)


def _shard_layout(engine: Engine) -> list[dict]:
    """What a rank's optimizer shard covers: enough to check (and later reshape) it on load."""
    if _units(engine) is not None:
        return [{"unit": unit.name,
                 "segments": [{"params": [(engine.param_names.get(id(p), "<unnamed>"), p.numel(), offset)
                                          for p, offset in zip(s.params, s.layout.offsets)],
                               "shard": s.layout.shard, "owned_range": s.layout.owned_range(s.rank)}
                              for s in unit.segments]}
                for unit in _units(engine)]
    return [{"params": [(engine.param_names[id(p)], p.numel(), offset)
                        for p, offset in zip(fg.params, fg.layout.offsets)],
             "shard": fg.layout.shard, "owned_range": fg.layout.owned_range(fg.rank)}
            for fg in engine.state.flat_groups]


def swap_dir(rank: int) -> str:
    return f"optimizer_swap_rank{rank}"


def _sharded_optimizer_state(engine: Engine) -> dict:
    return {"optimizer": engine.optimizer.state_dict(), "dp_world_size": engine.dp_world_size,
            "swapped_state_keys": list(getattr(engine.state.placement, "state_keys", [])),
            "layout": _shard_layout(engine),
            "fp32_master_shards": [m.detach().clone() for m in engine.state.masters] if engine.state.separate else []}


def _module_state(engine: Engine) -> dict:
    """The module's state dict without ZeRO-3-partitioned parameters (their shards are saved per rank);
    tensor-parallel shards joined into full tensors (a collective over the tp group)."""
    items = [(key, value) for key, value in engine.module.state_dict(keep_vars=True).items()
             if sharded_param_of(value) is None]
    return dict(iter_full_tensors(items, engine.mesh.group("tp")))


def _param_shards(engine: Engine) -> dict:
    return {"layout": _shard_layout(engine),
            "shards": [[s.read_local() for s in unit.segments] for unit in _units(engine)]}


@torch.no_grad()
def _load_sharded_optimizer_state(engine: Engine, saved: dict, path: Path, module_state: dict) -> None:
    engine.optimizer.load_state_dict(saved["optimizer"])
    placement = engine.state.placement
    if not placement.resident:  # NVMe offload: masters and state are the swap files saved beside
        placement.copy_files_from(path.parent / swap_dir(engine.global_rank), saved["swapped_state_keys"])
        return
    if engine.state.separate:
        # an fp32 checkpoint has no separate masters: its weights are the exact fp32 values
        shards = saved["fp32_master_shards"] or _master_shards_from_weights(engine, module_state)
        with torch.no_grad():
            for master, shard in zip(engine.state.masters, shards):
                master.copy_(shard)


def _master_shards_from_weights(engine: Engine, module_state: dict) -> list[torch.Tensor]:
    """This rank's fp32 master slice of every flat group, cut from whole (fp32) weights by name."""
    shards = []
    for fg in engine.state.flat_groups:
        start, end = fg.layout.owned_range(fg.rank)
        shard = torch.zeros(end - start, dtype=torch.float32)
        for piece in fg.layout.owned_pieces(fg.rank):
            weight = module_state[engine.param_names[id(fg.params[piece.param])]].reshape(-1)
            shard[piece.flat_offset - start:piece.flat_offset - start + piece.length] = \
                weight[piece.param_offset:piece.param_offset + piece.length].float()
        shards.append(shard)
    return shards


def _agreed_tag(engine: Engine, tag: str) -> str:
    """The tag every rank saves under: rank 0's. Ranks passing different tags is handled as
    ``checkpoint.tag_validation`` says (DeepSpeed's key): Fail raises, Warn logs, Ignore says nothing;
    the files always go to one tag, so the checkpoint stays whole."""
    tags = comm.all_gather_object(tag, None if engine.world_size == 1 else torch.distributed.group.WORLD)
    if len(set(tags)) != 1:
        policy = engine._config.checkpoint.tag_validation
        message = f"ranks passed different checkpoint tags: {tags}"
        if policy == "Fail":
            raise CheckpointError(f"{message} (checkpoint.tag_validation is Fail)")
        if policy == "Warn":
            log_rank0("%s; saving every rank under rank 0's tag '%s' (checkpoint.tag_validation: Warn)", message,
                      tags[0], rank=engine.global_rank, level=logging.WARNING)
    return tags[0]


def save_engine_checkpoint(engine: Engine, save_dir: str, tag: str | None, client_state: dict,
                           save_latest: bool) -> None:
    tag = _agreed_tag(engine, str(tag) if tag is not None else f"global_step{engine.global_steps}")
    check_tag(tag)
    if engine.global_rank == 0:
        prepare_partial_dir(save_dir, tag)
    comm.barrier()
    staging = partial_dir(save_dir, tag)
    written: list[tuple[str, int, str]] = []  # this rank's manifest entries
    first_replica = engine.mesh.rank("dp_sp") == 0  # the tp ranks of each stage's first model replica
    module_state = _module_state(engine) if first_replica else None
    if first_replica and engine.mesh.rank("tp") == 0:
        written.append(write_file_atomically({
            "module": module_state,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "loss_scaler": engine.loss_scaler.state_dict(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "client_state": client_state, "config": engine.config,
            "layout": {"dp_world_size": engine.dp_world_size, "zero_stage": engine.zero_optimization_stage(),
                       "precision": engine.policy.name, "tp_size": engine.mesh.size("tp"),
                       "sp_size": engine.mesh.size("sp"), "pp_size": engine.mesh.size("pp")},
        }, staging / model_file(engine)))
    if first_replica and not engine.sharded and engine.optimizer is not None:
        written.append(write_file_atomically(_optimizer_state_by_name(engine), staging / optim_file(engine)))
    if engine.sharded and engine.optimizer is not None:
        written.append(write_file_atomically(_sharded_optimizer_state(engine),
                                             staging / optim_shard_file(engine.global_rank)))
        if not engine.state.placement.resident:
            engine.state.placement.copy_files_to(staging / swap_dir(engine.global_rank))
            written += describe_files(staging / swap_dir(engine.global_rank), staging)
    if _units(engine) is not None:
        written.append(write_file_atomically(_param_shards(engine), staging / param_shard_file(engine.global_rank)))
    compression_state = _compression_state(engine)
    if compression_state:  # error-feedback buffers differ per rank: part of the training state
        written.append(write_file_atomically(compression_state, staging / compression_file(engine.global_rank)))
    written.append(write_file_atomically(_rng_state(), staging / rng_file(engine.global_rank)))
    everyone = comm.all_gather_object(written, None if engine.world_size == 1 else torch.distributed.group.WORLD)
    if engine.global_rank == 0:
        write_manifest(staging, [entry for entries in everyone for entry in entries])
        final = publish(save_dir, tag, save_latest)
        get_logger().info("saved checkpoint %s", final)
        keep = engine._config.checkpoint.keep_last
        if keep is not None:
            for old in retain_newest(save_dir, keep):
                get_logger().info("deleted checkpoint %s (checkpoint.keep_last: %d)", Path(save_dir) / old, keep)
    comm.barrier()


def _load_module(engine: Engine, saved: dict, directory: Path) -> None:
    """Whole tensors from ``model_states.pt``; at stage 3 the partitioned ones from this rank's shard file
    (both already checked against the model by ``_read_and_check``)."""
    if _units(engine) is None:
        engine.module.load_state_dict(shard_state_dict(engine.module, saved["module"]), strict=False)
        return
    engine.module.load_state_dict(saved["module"], strict=False)
    for unit, shards in zip(_units(engine), saved["_param_shards"]["shards"]):
        for segment, shard in zip(unit.segments, shards):
            segment.overwrite_local(shard, notify=False)


def _verify_before_loading(engine: Engine, directory: Path) -> None:
    """Every file this rank will read matches the manifest -- checked on all ranks before any of them
    touches its engine; one rank's damaged file is every rank's error (no rank is left waiting)."""
    error = None
    try:
        manifest = read_manifest(directory)
        mine = [name for name in manifest if _read_by_this_rank(engine, name)]
        verify_files(directory, mine, manifest)
    except CheckpointError as caught:
        error = str(caught)
    errors = comm.all_gather_object(error, None if engine.world_size == 1 else torch.distributed.group.WORLD)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _read_by_this_rank(engine: Engine, name: str) -> bool:
    rank = engine.global_rank
    own = {model_file(engine), optim_file(engine), optim_shard_file(rank), param_shard_file(rank),
           compression_file(rank), rng_file(rank)}
    return name in own or name.startswith(swap_dir(rank) + "/")


def load_engine_checkpoint(engine: Engine, load_dir: str, tag: str | None, *, load_module_strict: bool,
                           load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_only: bool) -> tuple[str | None, dict | None]:
    """Verify, read and check everything first (on every rank, errors shared), then change the engine:
    a checkpoint that does not fit is refused before a single weight is overwritten."""
    resolved = resolve_tag(load_dir, tag)
    if resolved is None:
        get_logger().warning("no 'latest' file in %s and no tag given: nothing loaded", load_dir)
        return None, None
    directory = tag_directory(load_dir, resolved)
    if not (directory / model_file(engine)).is_file() and (directory / MODEL_FILE).is_file():
        raise CheckpointError(f"{directory} was saved without pipeline stages; loading it with "
                              f"{engine.mesh.size('pp')} stages is not supported yet")
    _verify_before_loading(engine, directory)
    with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    saved, optimizer_file = _shared(engine, lambda: _read_and_check(engine, directory, load_module_strict,
                                                                    with_optimizer))
    _load_module(engine, saved, directory)
    engine.state.reload_from_model()
    if load_module_only:
        return str(directory), saved["client_state"]
    if optimizer_file is not None:
        optimizer_saved, path = optimizer_file
        whole = shard_state_dict(engine.module, saved["module"])  # this tp rank's part of every weight
        if engine.sharded:
            _load_sharded_optimizer_state(engine, optimizer_saved, path, whole)
        else:
            _load_optimizer_state_by_name(engine, optimizer_saved, whole)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    engine.loss_scaler.load_state_dict(saved["loss_scaler"])
    if _compression_state(engine):
        path = directory / compression_file(engine.global_rank)
        if path.is_file():
            _load_compression_state(engine, read_file(path, "gradient compression residuals"))
        else:
            get_logger().warning("%s not found (saved without compression): error feedback starts at zero", path)
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


def _shared(engine: Engine, work: Callable[[], Any]) -> Any:
    """Run ``work`` on every rank; if it raised CheckpointError on any rank, raise the first on all."""
    result, error = None, None
    try:
        result = work()
    except CheckpointError as caught:
        error = str(caught)
    errors = comm.all_gather_object(error, None if engine.world_size == 1 else torch.distributed.group.WORLD)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)
    return result


def _read_and_check(engine: Engine, directory: Path, strict: bool, with_optimizer: bool) -> tuple[dict, Any]:
    """Read what this rank loads and refuse a mismatch (model, shapes, layout) before anything changes."""
    path = directory / model_file(engine)
    saved = read_file(path, "model states")
    units = _units(engine)
    saved_stage, stage = saved["layout"]["zero_stage"], engine.zero_optimization_stage()
    if (units is not None) != (saved_stage == 3):
        raise CheckpointError(f"{directory} was saved at ZeRO stage {saved_stage}; loading it at stage {stage} is not "
                              "supported yet (the weights of a stage-3 run can be exported with save_16bit_model)")
    if units is None:
        _check_module_fits(engine, shard_state_dict(engine.module, saved["module"]), path, strict)
    else:
        expected = set(_module_state(engine))
        if strict and set(saved["module"]) != expected:
            raise CheckpointError(f"{path} does not fit this model: missing {sorted(expected - set(saved['module']))[:3]}"
                                  f", unexpected {sorted(set(saved['module']) - expected)[:3]}")
        shards_path = directory / param_shard_file(engine.global_rank)
        shards = read_file(shards_path, "ZeRO-3 parameter shards")
        if shards["layout"] != _shard_layout(engine):
            raise CheckpointError(f"{shards_path} covers different parameters or ranges than this model's ZeRO-3 "
                                  "layout (saved on another number of data-parallel ranks, or another model)")
        saved["_param_shards"] = shards
    if not with_optimizer:
        return saved, None
    if (saved_stage == 0) != (stage == 0):
        raise CheckpointError(f"{directory} was saved at ZeRO stage {saved_stage}; loading its optimizer state at "
                              f"stage {stage} is not supported yet (load_module_only=True loads the weights)")
    saved_tp = saved["layout"].get("tp_size", 1)
    if saved_tp != engine.mesh.size("tp"):
        raise CheckpointError(f"{directory} holds optimizer state for tensor-parallel size {saved_tp}; loading it "
                              f"at size {engine.mesh.size('tp')} is not supported yet (load_module_only=True "
                              "loads the weights, which are saved whole)")
    saved_dp = saved["layout"]["dp_world_size"]
    if engine.sharded and saved_dp != engine.dp_world_size:
        raise CheckpointError(f"{directory} holds ZeRO optimizer shards for {saved_dp} data-parallel ranks; "
                              f"loading them on {engine.dp_world_size} ranks is not supported yet (resume with "
                              f"{saved_dp} ranks, or pass load_optimizer_states=False)")
    if engine.sharded:
        optimizer_path = directory / optim_shard_file(engine.global_rank)
        optimizer_saved = read_file(optimizer_path, "optimizer shard")
        if optimizer_saved["layout"] != _shard_layout(engine):
            raise CheckpointError(f"{optimizer_path} covers different parameters or ranges than this model's ZeRO layout")
        if units is not None and engine.state.separate and not optimizer_saved["fp32_master_shards"]:
            raise CheckpointError(f"{optimizer_path} was saved in {saved['layout']['precision']}; loading its optimizer "
                                  f"state into a {engine.policy.name} run at ZeRO stage 3 is not supported yet")
    else:
        optimizer_path = directory / optim_file(engine)
        optimizer_saved = read_file(optimizer_path, "optimizer states")
        order = _position_names(engine)
        saved_names = [n for group in optimizer_saved["param_groups"] for n in group["params"]]
        if sorted(saved_names) != sorted(order):
            missing = sorted(set(order) - set(saved_names))[:3]
            extra = sorted(set(saved_names) - set(order))[:3]
            raise CheckpointError(f"optimizer state in {optimizer_path} does not match this model's trainable "
                                  f"parameters (missing: {missing}, unexpected: {extra})")
    return saved, (optimizer_saved, optimizer_path)


def _check_module_fits(engine: Engine, saved: dict, path: Path, strict: bool) -> None:
    """One line naming the first parameter or buffer whose name or shape does not match (dtypes are
    converted: an fp32 checkpoint loads into a bf16 run)."""
    live = engine.module.state_dict()
    for name, tensor in live.items():
        if name not in saved:
            if strict:
                raise CheckpointError(f"{path} does not fit this model: '{name}' is missing from the checkpoint")
        elif tuple(saved[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{path} does not fit this model: '{name}' has shape {tuple(saved[name].shape)} in "
                                  f"the checkpoint and {tuple(tensor.shape)} in the model")
    unexpected = [name for name in saved if name not in live]
    if strict and unexpected:
        raise CheckpointError(f"{path} does not fit this model: '{unexpected[0]}' is in the checkpoint but not in "
                              "the model")
