"""Checkpoint state that does not depend on the layout: each rank saves the pieces it holds, by name.

A rank's file ``shard_rank{r}.pt`` lists, for every piece of a parameter the rank holds (see
``zero/held.py``): the parameter's name, its full logical shape, the tensor-parallel piece the rank
trains (if any), the flat range ``[start, stop)`` of that piece, and what the values are -- the
weights (stage 3: they are partitioned), the fp32 masters (mixed precision) or one optimizer state
tensor (``optim.exp_avg``, ...). Scalars of the optimizer state (Adam's ``step``) are kept per name.
Whole weights of the unpartitioned stages stay in ``model_states*.pt`` (keyed by name, tp joined).

Loading at any other layout is then a lookup: every rank asks, for each piece *it* holds now, for
the values of that range, and ``PieceReader`` assembles them from whichever files hold them. Files
are opened with ``mmap`` (``torch.load(weights_only=True)``), so a rank reads the bytes of the pieces
it needs and holds at most its own share plus one whole tensor (the one being cut) in memory.
Why not ``torch.distributed.checkpoint``: see docs/architecture.md ("Checkpoint layout").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import AbstractSet, Iterable

import torch

from zerotune.checkpoint.atomic import CheckpointError
from zerotune.checkpoint.train_state import TrainState
from zerotune.parallel.tensor.layout import (
    TPLayout,
    shard_tensor,
    tp_layout_of,
    unshard_tensor,
)
from zerotune.parallel.tensor.state_dict import full_shape
from zerotune.zero.held import MASTER, OPTIM, WEIGHT, tp_of, weight_kind
from zerotune.zero.stage3.sharded_param import sharded_param_of

SHARD_FILE_PATTERN = re.compile(r"shard_rank\d+\.pt")


def shard_file(rank: int) -> str:
    return f"shard_rank{rank}.pt"


def rank_pieces(train: TrainState, *, weights: bool, optimizer: bool) -> dict:
    """This rank's held pieces (``ZeroState.state_dict``): ``weights`` the partitioned weights (stage 3),
    ``optimizer`` the fp32 masters (mixed precision) and the optimizer state."""
    try:
        return train.stage.state_dict(train.optimizer if optimizer else None, train.param_names,
                                       weights=weights, masters=optimizer and train.mixed_precision)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


class PieceReader:
    """The values of any range of any parameter, assembled from the rank files and whole weights that hold them.

    ``whole``: name -> full tensor (``model_states*.pt``, mmap'd); ``files``: file name -> a loaded rank
    file (mmap'd). The last assembled tensor is cached: consecutive pieces of one parameter cost one read.
    """

    def __init__(self, directory: Path, whole: dict[str, torch.Tensor], files: dict[str, dict]) -> None:
        self.directory = directory
        self.whole = whole
        self.index: dict[tuple[str, str], list[tuple[str, dict]]] = {}
        self.kinds: dict[str, set[str]] = {}  # name -> the kinds saved for it
        self.scalars: dict[str, dict] = {}
        self.files = files
        for file, content in files.items():
            for entry in content["entries"]:
                self.index.setdefault((entry["name"], entry["kind"]), []).append((file, entry))
                self.kinds.setdefault(entry["name"], set()).add(entry["kind"])
            self.scalars.update(content["scalars"])
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def names(self) -> set[str]:
        return set(self.whole) | set(self.kinds)

    def has(self, name: str, kind: str) -> bool:
        return (kind == WEIGHT and name in self.whole) or (name, kind) in self.index

    def optimizer_keys(self, name: str) -> list[str]:
        return sorted(kind[len(OPTIM):] for kind in self.kinds.get(name, ()) if kind.startswith(OPTIM))

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.whole:
            return tuple(self.whole[name].shape)
        for kind in self.kinds.get(name, ()):
            return tuple(self.index[(name, kind)][0][1]["shape"])
        return None

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``: the fp32 masters when saved (exact), else the weights."""
        if (name, MASTER) not in self.index and name in self.whole:
            return self.whole[name]
        kind = MASTER if (name, MASTER) in self.index else WEIGHT
        if (name, kind) not in self.index:
            raise CheckpointError(f"{self.directory} has no values for '{name}'")
        return self._full(name, kind, self.index[(name, kind)])

    def full_dtype(self, name: str) -> torch.dtype:
        """The dtype ``full(name)`` returns, read without assembling the tensor (a lazy consolidation's handle)."""
        if (name, MASTER) not in self.index and name in self.whole:
            return self.whole[name].dtype
        kind = MASTER if (name, MASTER) in self.index else WEIGHT
        if (name, kind) not in self.index:
            raise CheckpointError(f"{self.directory} has no values for '{name}'")
        file, entry = self.index[(name, kind)][0]
        return self.files[file]["tensors"][entry["key"]].dtype

    def files_for(self, wanted: Iterable[tuple[str, str]]) -> set[str]:
        return {file for key in wanted for file, _ in self.index.get(key, [])}

    def local(self, name: str, kind: str, param: torch.Tensor) -> torch.Tensor:
        """The flattened values of ``param``'s tensor-parallel piece (the whole tensor without tp) of ``kind``."""
        target = tp_layout_of(param)
        piece = tp_of(param)
        cache_key = (name, kind, tuple(piece) if piece is not None else None)
        if self._cache is not None and self._cache[0] == cache_key:
            return self._cache[1]
        if kind == WEIGHT and name in self.whole:
            full = self.whole[name]
            values = (shard_tensor(full, target) if target is not None else full).reshape(-1)
        else:
            found = self.index.get((name, kind))
            if not found:
                raise CheckpointError(f"{self.directory} has no {kind} values for '{name}'")
            if all(entry["tp"] == tp_of(param) for _, entry in found):  # saved with this very tp piece
                values = self._assemble(name, kind, found, param.numel())
            else:
                full = self._full(name, kind, found)
                values = (shard_tensor(full, target) if target is not None else full).reshape(-1)
        self._cache = (cache_key, values)
        return values

    def _assemble(self, name: str, kind: str, found: list[tuple[str, dict]], numel: int) -> torch.Tensor:
        first = self.files[found[0][0]]["tensors"][found[0][1]["key"]]
        out = torch.empty(numel, dtype=first.dtype)
        covered = torch.zeros(numel, dtype=torch.bool)
        for file, entry in found:
            out[entry["start"]:entry["stop"]] = self.files[file]["tensors"][entry["key"]]
            covered[entry["start"]:entry["stop"]] = True
        if not bool(covered.all()):
            raise CheckpointError(f"{self.directory} holds only part of '{name}' ({kind}): the files of some ranks are "
                                  "missing from the checkpoint")
        return out

    def _full(self, name: str, kind: str, found: list[tuple[str, dict]]) -> torch.Tensor:
        shape = list(found[0][1]["shape"])
        numel = torch.Size(shape).numel()
        replicated = [item for item in found if item[1]["tp"] is None]
        if replicated:
            return self._assemble(name, kind, replicated, numel).view(shape)
        dim, world, _, full_size, parts = found[0][1]["tp"]
        local_shape = list(shape)
        local_shape[dim % len(shape)] = full_size // world
        shards = [self._assemble(name, kind, [item for item in found if item[1]["tp"][2] == rank],
                                 torch.Size(local_shape).numel()).view(local_shape) for rank in range(world)]
        return unshard_tensor(shards, TPLayout(dim, world, 0, full_size, parts))


# ---- a train state against a reader: check first, then load -------------------------------------
def _module_entries(train: TrainState, skip: AbstractSet[str]) -> list[tuple[str, str, torch.Tensor]]:
    """``(state-dict key, name to look up, live tensor)`` of the module; a tied weight's second key looks up
    the name its parameter was saved under."""
    entries = []
    for key, tensor in train.module.state_dict(keep_vars=True).items():
        if key not in skip:
            entries.append((key, train.param_names.get(id(tensor), key), tensor))
    return entries


def _optimizer(train: TrainState) -> torch.optim.Optimizer:
    """The optimizer whose state is checked or loaded (callers ask only when the engine has one)."""
    if train.optimizer is None:
        raise CheckpointError("loading optimizer states needs an optimizer, and this engine has none "
                              "(load_optimizer_states=False loads the weights only)")
    return train.optimizer


def _lookup(reader: PieceReader, key: str, name: str) -> str:
    return key if reader.has(key, WEIGHT) or reader.has(key, MASTER) else name


def check_fits(train: TrainState, reader: PieceReader, *, strict: bool, skip: AbstractSet[str], with_optimizer: bool,
               saved_groups: list | None) -> list[tuple[str, str]]:
    """Refuse a checkpoint that does not fit this train state -- one line naming the first parameter whose name or
    shape does not match -- and return the ``(name, kind)`` pieces this rank will read."""
    needed: list[tuple[str, str]] = []
    known: set[str] = set()
    for key, name, tensor in _module_entries(train, skip):
        known.update((key, name))
        found = _lookup(reader, key, name)
        shape = reader.shape(found)
        if shape is None:
            if strict:
                raise CheckpointError(f"{reader.directory} does not fit this model: '{key}' is missing from the "
                                      "checkpoint")
            continue
        if shape != tuple(full_shape(tensor)):
            raise CheckpointError(f"{reader.directory} does not fit this model: '{key}' has shape {shape} in the "
                                  f"checkpoint and {tuple(full_shape(tensor))} in the model")
        needed.append((found, weight_kind(reader, found, tensor)))
    if strict and train.mesh.size("pp") == 1:  # (a pipeline stage holds only its own layers)
        unexpected = sorted(reader.names() - known - set(skip))
        if unexpected:
            raise CheckpointError(f"{reader.directory} does not fit this model: '{unexpected[0]}' is in the "
                                  "checkpoint but not in the model")
    if with_optimizer:
        groups = _optimizer(train).param_groups
        if saved_groups is not None and len(saved_groups) != len(groups):
            raise CheckpointError(f"{reader.directory} holds {len(saved_groups)} optimizer parameter groups; this "
                                  f"run has {len(groups)} (load_optimizer_states=False loads the weights only)")
        any_state = any(kind.startswith(OPTIM) for kinds in reader.kinds.values() for kind in kinds)
        for pieces in train.stage.master_pieces():
            for piece in pieces:
                name = train.param_names[id(piece.param)]
                keys = reader.optimizer_keys(name)
                if any_state and not keys:
                    raise CheckpointError(f"{reader.directory} has no optimizer state for '{name}' (saved with "
                                          "another model, or with that parameter frozen)")
                needed += [(name, weight_kind(reader, name, torch.empty(0)))] + [(name, OPTIM + k) for k in keys]
    return needed


@torch.no_grad()
def load_weights(train: TrainState, reader: PieceReader, skip: AbstractSet[str] = frozenset()) -> None:
    """Every weight and buffer of this rank, at its layout (checked by ``check_fits``): the module's own
    tensors here, the partitioned ones (stage 3) by the state; the masters follow the weights."""
    for key, name, tensor in _module_entries(train, skip):
        found = _lookup(reader, key, name)
        if sharded_param_of(tensor) is not None or reader.shape(found) is None:
            continue
        tensor.data.copy_(reader.local(found, weight_kind(reader, found, tensor), tensor).view(tensor.shape))
    train.stage.load_state_dict(reader, None, train.param_names, skip=skip)


@torch.no_grad()
def load_optimizer_state(train: TrainState, reader: PieceReader, saved_groups: list | None) -> None:
    """The fp32 masters and optimizer state of every master this rank holds (``ZeroState.load_state_dict``),
    then the groups' settings."""
    optimizer = _optimizer(train)
    train.stage.load_state_dict(reader, optimizer, train.param_names, weights=False)
    for group, saved in zip(optimizer.param_groups, saved_groups or []):
        group.update({k: v for k, v in saved.items() if k != "params"})
