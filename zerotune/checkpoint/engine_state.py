"""Save and load everything a run needs to continue bit-identically (the files are described in
``engine_parts.py``; the directory protocol and verification in ``atomic.py``).

Save: every rank writes its parts into the staging directory and hashes them; rank 0 writes the
manifest and publishes. Load: every rank verifies the files it reads against the manifest, reads
them and checks that they fit this engine (model, shapes, layout, frozen base) -- errors are shared,
so all ranks raise together -- and only then changes its engine.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from zerotune.checkpoint.atomic import (
    CheckpointError,
    check_tag,
    describe_files,
    partial_dir,
    prepare_partial_dir,
    publish,
    read_file,
    read_manifest,
    resolve_tag,
    retain_newest,
    tag_directory,
    verify_files,
    write_file_atomically,
    write_manifest,
)
from zerotune.checkpoint.engine_parts import (
    MODEL_FILE,
    check_frozen_base,
    compression_file,
    compression_state,
    frozen_fingerprint,
    frozen_names,
    load_compression_state,
    load_optimizer_state_by_name,
    load_sharded_optimizer_state,
    model_file,
    module_state,
    optim_file,
    optim_shard_file,
    optimizer_state_by_name,
    param_shard_file,
    param_shards,
    position_names,
    rng_file,
    rng_state,
    set_rng_state,
    shard_layout,
    sharded_optimizer_state,
    swap_dir,
    units,
)
from zerotune.distributed import comm
from zerotune.monitor.logging import get_logger, log_rank0
from zerotune.parallel.tensor.state_dict import shard_state_dict

if TYPE_CHECKING:
    from zerotune.engine import Engine


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
                           save_latest: bool, exclude_frozen: bool = False) -> None:
    tag = _agreed_tag(engine, str(tag) if tag is not None else f"global_step{engine.global_steps}")
    check_tag(tag)
    if engine.global_rank == 0:
        prepare_partial_dir(save_dir, tag)
    comm.barrier()
    staging = partial_dir(save_dir, tag)
    written: list[tuple[str, int, str]] = []  # this rank's manifest entries
    first_replica = engine.mesh.rank("dp_sp") == 0  # the tp ranks of each stage's first model replica
    weights = module_state(engine) if first_replica else None
    extra = {}
    if exclude_frozen and units(engine) is None and first_replica and frozen_names(engine):
        extra["frozen_fingerprint"] = frozen_fingerprint(engine, weights)
        weights = {k: v for k, v in weights.items() if k not in set(frozen_names(engine))}
    if first_replica and engine.mesh.rank("tp") == 0:
        written.append(write_file_atomically({
            **extra, "module": weights,
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
        written.append(write_file_atomically(optimizer_state_by_name(engine), staging / optim_file(engine)))
    if engine.sharded and engine.optimizer is not None:
        written.append(write_file_atomically(sharded_optimizer_state(engine),
                                             staging / optim_shard_file(engine.global_rank)))
        if not engine.state.placement.resident:
            engine.state.placement.copy_files_to(staging / swap_dir(engine.global_rank))
            written += describe_files(staging / swap_dir(engine.global_rank), staging)
    if units(engine) is not None:
        written.append(write_file_atomically(param_shards(engine), staging / param_shard_file(engine.global_rank)))
    residuals = compression_state(engine)
    if residuals:  # error-feedback buffers differ per rank: part of the training state
        written.append(write_file_atomically(residuals, staging / compression_file(engine.global_rank)))
    written.append(write_file_atomically(rng_state(), staging / rng_file(engine.global_rank)))
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
    if units(engine) is None:
        engine.module.load_state_dict(shard_state_dict(engine.module, saved["module"]), strict=False)
        return
    engine.module.load_state_dict(saved["module"], strict=False)
    for unit, shards in zip(units(engine), saved["_param_shards"]["shards"]):
        for segment, shard in zip(unit.segments, shards):
            segment.overwrite_local(shard, notify=False)


def _verify_before_loading(engine: Engine, directory: Path) -> None:
    """Every file this rank will read matches the manifest -- checked on all ranks before any of them
    touches its engine; one rank's damaged file is every rank's error (no rank is left waiting)."""
    def verify() -> None:
        manifest = read_manifest(directory)
        verify_files(directory, [name for name in manifest if _read_by_this_rank(engine, name)], manifest)

    _shared(engine, verify)


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
            load_sharded_optimizer_state(engine, optimizer_saved, path, whole)
        else:
            load_optimizer_state_by_name(engine, optimizer_saved, whole)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    engine.loss_scaler.load_state_dict(saved["loss_scaler"])
    if compression_state(engine):
        path = directory / compression_file(engine.global_rank)
        if path.is_file():
            load_compression_state(engine, read_file(path, "gradient compression residuals"))
        else:
            get_logger().warning("%s not found (saved without compression): error feedback starts at zero", path)
    for counter in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
        setattr(engine, counter, saved[counter])
    rng_path = directory / rng_file(engine.global_rank)
    if rng_path.is_file():
        set_rng_state(read_file(rng_path, "RNG state"))
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
    partitioned = units(engine)
    saved_stage, stage = saved["layout"]["zero_stage"], engine.zero_optimization_stage()
    if (partitioned is not None) != (saved_stage == 3):
        raise CheckpointError(f"{directory} was saved at ZeRO stage {saved_stage}; loading it at stage {stage} is not "
                              "supported yet (the weights of a stage-3 run can be exported with save_16bit_model)")
    if partitioned is None:
        frozen = set()
        if "frozen_fingerprint" in saved:
            check_frozen_base(engine, saved, path)
            frozen = set(frozen_names(engine))
        _check_module_fits(engine, shard_state_dict(engine.module, saved["module"]), path, strict, skip=frozen)
    else:
        expected = set(module_state(engine))
        if strict and set(saved["module"]) != expected:
            raise CheckpointError(f"{path} does not fit this model: missing {sorted(expected - set(saved['module']))[:3]}"
                                  f", unexpected {sorted(set(saved['module']) - expected)[:3]}")
        shards_path = directory / param_shard_file(engine.global_rank)
        shards = read_file(shards_path, "ZeRO-3 parameter shards")
        if shards["layout"] != shard_layout(engine):
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
        if optimizer_saved["layout"] != shard_layout(engine):
            raise CheckpointError(f"{optimizer_path} covers different parameters or ranges than this model's ZeRO layout")
        if partitioned is not None and engine.state.separate and not optimizer_saved["fp32_master_shards"]:
            raise CheckpointError(f"{optimizer_path} was saved in {saved['layout']['precision']}; loading its optimizer "
                                  f"state into a {engine.policy.name} run at ZeRO stage 3 is not supported yet")
    else:
        optimizer_path = directory / optim_file(engine)
        optimizer_saved = read_file(optimizer_path, "optimizer states")
        order = position_names(engine)
        saved_names = [n for group in optimizer_saved["param_groups"] for n in group["params"]]
        if sorted(saved_names) != sorted(order):
            missing = sorted(set(order) - set(saved_names))[:3]
            extra = sorted(set(saved_names) - set(order))[:3]
            raise CheckpointError(f"optimizer state in {optimizer_path} does not match this model's trainable "
                                  f"parameters (missing: {missing}, unexpected: {extra})")
    return saved, (optimizer_saved, optimizer_path)


def _check_module_fits(engine: Engine, saved: dict, path: Path, strict: bool, skip: set[str] = frozenset()) -> None:
    """One line naming the first parameter or buffer whose name or shape does not match (dtypes are
    converted: an fp32 checkpoint loads into a bf16 run). ``skip``: frozen weights saved as a fingerprint."""
    live = engine.module.state_dict()
    for name, tensor in live.items():
        if name in skip:
            continue
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
