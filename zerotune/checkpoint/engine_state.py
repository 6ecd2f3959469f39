"""Save and load everything a run needs to continue bit-identically, from and into a train state
(``train_state.py``; the files are described in ``engine_parts.py``, the directory protocol and verification
in ``atomic.py``).

Save: every rank writes its parts into the staging directory and hashes them; rank 0 writes the
manifest and publishes. Load: every rank verifies the files it reads against the manifest, reads
them and checks that they fit this train state (model, shapes, layout, frozen base) -- errors are shared,
so all ranks raise together -- and only then changes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from zerotune.checkpoint.atomic import (
    CheckpointError,
    CheckpointTagMismatch,
    check_loadable,
    check_tag,
    partial_dir,
    prepare_partial_dir,
    publish,
    read_file,
    read_manifest,
    recover,
    resolve_tag,
    retain_newest,
    tag_directory,
    verify_files,
    write_file_atomically,
    write_manifest,
)
from zerotune.checkpoint.deepspeed_format import as_piece_reader, is_deepspeed_checkpoint, read_deepspeed_checkpoint
from zerotune.checkpoint.engine_parts import (
    MODEL_FILE_PATTERN,
    check_frozen_base,
    compression_file,
    compression_state,
    frozen_fingerprint,
    frozen_names,
    load_compression_state,
    loaded_sparse_names,
    model_description,
    model_file,
    module_state,
    rng_file,
    rng_state,
    set_rng_state,
)
from zerotune.checkpoint.logical import (
    SHARD_FILE_PATTERN,
    PieceReader,
    check_fits,
    load_optimizer_state,
    load_weights,
    rank_pieces,
    shard_file,
)
from zerotune.checkpoint.train_state import Counters, TrainState
from zerotune.distributed import comm
from zerotune.monitor.logging import get_logger, log_rank0


def _agreed_tag(train: TrainState, tag: str) -> str:
    """The tag every rank saves under: rank 0's. Ranks passing different tags is handled as
    ``checkpoint.tag_validation`` says (DeepSpeed's key): Fail raises, Warn logs, Ignore says nothing;
    the files always go to one tag, so the checkpoint stays whole."""
    tags = comm.all_gather_object(tag, None if train.world_size == 1 else torch.distributed.group.WORLD)
    if len(set(tags)) != 1:
        policy = train.settings.tag_validation
        message = f"ranks passed different checkpoint tags: {tags}"
        if policy == "Fail":
            raise CheckpointTagMismatch(f"{message} (checkpoint.tag_validation is Fail)")
        if policy == "Warn":
            log_rank0("%s; saving every rank under rank 0's tag '%s' (checkpoint.tag_validation: Warn)", message,
                      tags[0], rank=train.rank, level=logging.WARNING)
    return tags[0]


def _layout(train: TrainState) -> dict:
    return {"dp_world_size": train.dp_world_size, "zero_stage": train.zero_stage,
            "precision": train.precision, "tp_size": train.mesh.size("tp"), "sp_size": train.mesh.size("sp"),
            "pp_size": train.mesh.size("pp")}


def save_engine_checkpoint(train: TrainState, save_dir: str, tag: str | None, client_state: dict,
                           save_latest: bool, exclude_frozen: bool = False) -> None:
    """Save ``tag`` (default ``global_step<N>``) into ``save_dir``.

    ``client_state`` is checked first: a value the loader would refuse (an ``nn.Module``) is named before
    anything is written, instead of making the whole checkpoint unloadable. A save that fails while writing
    (a full disk) names the checkpoint and the file, and rank 0 puts the directory back as it was before
    the save (``recover``: no staging directory left, the previous checkpoint and ``latest`` untouched).
    """
    check_loadable(client_state, "client_state")
    try:
        _write_checkpoint(train, save_dir, tag, client_state, save_latest, exclude_frozen)
    except (CheckpointError, OSError):
        if train.rank == 0:
            with contextlib.suppress(OSError):  # a disk too full even to clean up: the next save's recover() does it
                recover(save_dir)
        raise


def _write_checkpoint(train: TrainState, save_dir: str, tag: str | None, client_state: dict,
                      save_latest: bool, exclude_frozen: bool) -> None:
    tag = _agreed_tag(train, str(tag) if tag is not None else f"global_step{train.counters.global_steps}")
    check_tag(tag)
    if train.rank == 0:
        prepare_partial_dir(save_dir, tag)
    comm.barrier()
    staging = partial_dir(save_dir, tag)
    written: list[tuple[str, int, str]] = []  # this rank's manifest entries
    first_replica = train.mesh.rank("dp_sp") == 0  # the tp ranks of each stage's first model replica
    weights = module_state(train) if first_replica else None
    extra = {}
    if exclude_frozen and not train.stage.partitions_weights and weights is not None and frozen_names(train):
        extra["frozen_fingerprint"] = frozen_fingerprint(train, weights)
        weights = {k: v for k, v in weights.items() if k not in set(frozen_names(train))}
    if first_replica and train.mesh.rank("tp") == 0:
        written.append(write_file_atomically({
            **extra, "module": weights,
            **dataclasses.asdict(train.counters),
            "loss_scaler": train.loss_scaler.state_dict(),
            "lr_scheduler": train.lr_scheduler.state_dict() if train.lr_scheduler is not None else None,
            "client_state": client_state, "config": train.config,
            "optimizer_groups": train.group_hyperparameters(), "layout": _layout(train),
            "model_description": model_description(train.module),
            "trainable_names": [n for n, p in train.module.named_parameters() if p.requires_grad],
            "buffer_names": [n for n, _ in train.module.named_buffers()], "shared_params": _shared_params(train.module),
            "curriculum": train.curriculum, "sparse_tensor_module_names": train.sparse_tensor_module_names,
        }, staging / model_file(train)))
    # stage 0: masters and optimizer state are replicated (the first replica saves them); stages 1-3: every
    # rank saves its own slice; stage 3 also its weight shards
    pieces = rank_pieces(train, weights=train.stage.partitions_weights, optimizer=train.sharded or first_replica)
    if pieces["entries"] or pieces["scalars"]:
        written.append(write_file_atomically(pieces, staging / shard_file(train.rank)))
    residuals = compression_state(train)
    if residuals:  # error-feedback buffers differ per rank: part of the training state
        written.append(write_file_atomically(residuals, staging / compression_file(train.rank)))
    written.append(write_file_atomically(rng_state(), staging / rng_file(train.rank)))
    everyone = comm.all_gather_object(written, None if train.world_size == 1 else torch.distributed.group.WORLD)
    if train.rank == 0:
        write_manifest(staging, [entry for entries in everyone for entry in entries])
        final = publish(save_dir, tag, save_latest)
        get_logger().info("saved checkpoint %s", final)
        keep = train.settings.keep_last
        if keep is not None:
            for old in retain_newest(save_dir, keep):
                get_logger().info("deleted checkpoint %s (checkpoint.keep_last: %d)", Path(save_dir) / old, keep)
    comm.barrier()


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied parameters, as DeepSpeed records them: each further name of a parameter -> its first name (the one its
    values are saved under), so a consolidation (``checkpoint/consolidate.py``) gives every name the same tensor."""
    first: dict[int, str] = {}
    shared = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name:
            shared[name] = owner
    return shared


def _load_deepspeed(train: TrainState, directory: Path, tag: str | None, *, strict: bool, with_optimizer: bool,
                    with_scheduler: bool) -> tuple[str, dict]:
    """Migrate a DeepSpeed ZeRO 1/2/3 checkpoint: weights, and for a resume Adam state, step, counters and the
    LR schedule, at this run's layout (every rank reads the whole checkpoint: it has no manifest to verify,
    files are read with ``weights_only`` and DeepSpeed's few record types as inert stand-ins)."""
    with_optimizer = with_optimizer and train.optimizer is not None

    def read() -> tuple[Any, PieceReader]:
        checkpoint = read_deepspeed_checkpoint(directory, tag)
        reader = as_piece_reader(checkpoint, directory)
        check_fits(train, reader, strict=strict, skip=set(), with_optimizer=with_optimizer,
                   saved_groups=checkpoint.param_groups or None)
        return checkpoint, reader

    checkpoint, reader = _shared(train, read)
    load_weights(train, reader)
    if with_optimizer:
        load_optimizer_state(train, reader, checkpoint.param_groups)
        train.counters = Counters(global_steps=checkpoint.global_steps, global_samples=checkpoint.global_samples,
                                  micro_steps=checkpoint.global_steps * train.gradient_accumulation_steps,
                                  skipped_steps=checkpoint.skipped_steps)
    if with_scheduler and train.lr_scheduler is not None and checkpoint.lr_scheduler is not None:
        try:
            train.lr_scheduler.load_state_dict(checkpoint.lr_scheduler)
        except (KeyError, TypeError, ValueError) as error:
            log_rank0("DeepSpeed checkpoint %s: its LR scheduler state does not fit this run's scheduler (%s): the "
                      "schedule restarts", directory, error, rank=train.rank, level=logging.WARNING)
    log_rank0("loaded DeepSpeed checkpoint %s (ZeRO stage %d on %d ranks, DeepSpeed %s, step %d)", directory,
              checkpoint.zero_stage, checkpoint.dp_world_size, checkpoint.ds_version, checkpoint.global_steps,
              rank=train.rank)
    train.stage.zero_grad()
    return str(directory), checkpoint.client_state


def _verify(directory: Path, manifest: dict, names: list[str]) -> None:
    verify_files(directory, [name for name in names if name in manifest], manifest)


def load_engine_checkpoint(train: TrainState, load_dir: str, tag: str | None, *, load_module_strict: bool,
                           load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_only: bool) -> tuple[str | None, dict | None]:
    """Verify, read and check everything first (on every rank, errors shared), then change the train state:
    a checkpoint that does not fit is refused before a single weight is overwritten. Any saved layout
    loads at this one: each rank takes the pieces it now holds from whichever files hold them. A DeepSpeed
    ZeRO checkpoint directory is read too (``_load_deepspeed``)."""
    if is_deepspeed_checkpoint(Path(load_dir)):
        return _load_deepspeed(train, Path(load_dir), tag, strict=load_module_strict,
                               with_optimizer=load_optimizer_states and not load_module_only,
                               with_scheduler=load_lr_scheduler_states and not load_module_only)
    resolved = resolve_tag(load_dir, tag)
    if resolved is None:
        get_logger().warning("no 'latest' file in %s and no tag given: nothing loaded", load_dir)
        return None, None
    directory = tag_directory(load_dir, resolved)
    with_optimizer = load_optimizer_states and not load_module_only and train.optimizer is not None
    saved, reader = _shared(train, lambda: _read_and_check(train, directory, load_module_strict,
                                                                      with_optimizer))
    frozen = set(frozen_names(train)) if "frozen_fingerprint" in saved else set()
    load_weights(train, reader, skip=frozen)
    if load_module_only:
        return str(directory), saved["client_state"]
    if with_optimizer:
        load_optimizer_state(train, reader, saved.get("optimizer_groups"))
    if load_lr_scheduler_states and train.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        train.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    train.loss_scaler.load_state_dict(saved["loss_scaler"])
    if compression_state(train):
        path = directory / compression_file(train.rank)
        if path.is_file() and saved["layout"] == _layout(train):
            load_compression_state(train, read_file(path, "gradient compression residuals"))
        else:
            get_logger().warning("%s: no error-feedback state saved for this rank at this layout: it starts at zero",
                                 path)
    train.counters = Counters(**{name: saved[name] for name in ("global_steps", "global_samples", "micro_steps",
                                                                 "skipped_steps")})
    train.curriculum = saved.get("curriculum") or {}
    if "sparse_tensor_module_names" in saved:  # (checkpoints from before it was recorded keep this engine's)
        saved_params = set(saved["module"] or {}) | set(saved["trainable_names"])
        train.sparse_tensor_module_names = loaded_sparse_names(
            train.sparse_tensor_module_names, saved["sparse_tensor_module_names"],
            (name for name, _ in train.module.named_parameters()), saved_params, strict=load_module_strict)
    rng_path = directory / rng_file(train.rank)
    if rng_path.is_file():
        set_rng_state(read_file(rng_path, "RNG state"))
    else:
        get_logger().warning("%s not found (saved on %d data-parallel ranks): RNG state not restored",
                             rng_path, saved["layout"]["dp_world_size"])
    train.stage.zero_grad()
    return str(directory), saved["client_state"]


def load_newest_checkpoint(train: TrainState, save_dir: str) -> tuple[str | None, dict | None]:
    """Resume from the newest complete, verified checkpoint in ``save_dir``: the one ``latest`` names, else (it is
    damaged or incomplete) the next newest tag. Each candidate is verified before anything changes, and the
    verdict is shared by all ranks, so they all move on to the same next candidate."""
    directory = Path(save_dir)
    if not directory.is_dir():
        return None, None
    tags = sorted((p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")
                   and (p / "manifest.json").is_file()), key=lambda p: p.stat().st_mtime, reverse=True)
    latest = resolve_tag(directory, None) if (directory / "latest").is_file() else None
    candidates = ([latest] if latest else []) + [p.name for p in tags if p.name != latest]
    for tag in candidates:
        try:
            return load_engine_checkpoint(train, save_dir, tag, load_module_strict=True, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_only=False)
        except CheckpointError as error:
            log_rank0("checkpoint %s cannot be resumed from (%s); trying an older one", directory / tag, error,
                      rank=train.rank, level=logging.WARNING)
    return None, None


def _shared(train: TrainState, work: Callable[[], Any]) -> Any:
    """Run ``work`` on every rank; if it raised CheckpointError on any rank, raise the first on all."""
    result, error = None, None
    try:
        result = work()
    except CheckpointError as caught:
        error = str(caught)
    errors = comm.all_gather_object(error, None if train.world_size == 1 else torch.distributed.group.WORLD)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)
    return result


def _read_and_check(train: TrainState, directory: Path, strict: bool, with_optimizer: bool
                    ) -> tuple[dict, PieceReader]:
    """Read (mmap) and verify what this rank loads and refuse a mismatch (names, shapes, optimizer groups)
    before anything changes. Every model file is read (a pipeline stage's names may sit in any of them);
    of the rank files, only those holding pieces this rank needs are verified and used."""
    manifest = read_manifest(directory)
    model_files = sorted(name for name in manifest if MODEL_FILE_PATTERN.fullmatch(name))
    if not model_files:
        raise CheckpointError(f"{directory} has no model_states*.pt file listed in its manifest")
    _verify(directory, manifest, [*model_files, rng_file(train.rank),
                                          compression_file(train.rank)])
    models = {name: read_file(directory / name, "model states", mmap=True) for name in model_files}
    saved = models.get(model_file(train)) or models[model_files[0]]
    whole = {key: value for content in models.values() for key, value in content["module"].items()}
    rank_files = {}
    for name in filter(SHARD_FILE_PATTERN.fullmatch, manifest):
        try:
            rank_files[name] = read_file(directory / name, "parameter pieces", mmap=True)
        except CheckpointError:
            _verify(directory, manifest, [name])  # a damaged file says so
            raise
    reader = PieceReader(directory, whole, rank_files)
    frozen = set()
    if "frozen_fingerprint" in saved:
        if train.stage.partitions_weights:
            raise CheckpointError(f"{directory} was saved without its frozen base; loading it at ZeRO stage 3 is not "
                                  "supported yet (load it at stage 0-2, or save with exclude_frozen_parameters=False)")
        check_frozen_base(train, saved, directory / model_files[0])
        frozen = set(frozen_names(train))
    needed = check_fits(train, reader, strict=strict, skip=frozen, with_optimizer=with_optimizer,
                        saved_groups=saved.get("optimizer_groups"))
    _verify(directory, manifest, sorted(reader.files_for(needed)))
    return saved, reader


