"""One fp32 state dict from a whole checkpoint -- zerotune's (any layout) or DeepSpeed's ZeRO 1-3 -- as DeepSpeed's
``zero_to_fp32`` makes one (``compat/zero_to_fp32.py`` gives it DeepSpeed's names and command line).

Why a module of its own: ``zerotune export`` writes a Hugging Face directory (HF names, PEFT adapters, config.json);
this writes the training module's own state dict -- every parameter and buffer under its module name, tied weights
as one tensor under each name, frozen parameters optionally left out -- which ``model.load_state_dict`` takes.

The values are the exact fp32 masters where the checkpoint has them (mixed precision), else the weights as saved
(fp32 runs; frozen parameters and buffers keep their dtype, as in DeepSpeed's). Both readers are reused: zerotune's
checkpoints through ``export.open_checkpoint`` (verified against the manifest, files mmap'd, each tensor assembled
from the rank pieces only when asked for -- so ``lazy`` handles cost nothing until read, and a sharded write holds
one output shard plus one tensor), DeepSpeed's through ``deepspeed_format`` (which assembles every tensor as it reads
the files: there the lazy handles only defer a copy, as DeepSpeed's own lazy mode does).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from zerotune.checkpoint.atomic import (
    MANIFEST,
    CheckpointError,
    check_tag,
    read_file,
    resolve_tag,
    tag_directory,
)
from zerotune.checkpoint.deepspeed_format import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from zerotune.checkpoint.export import ShardWriter, open_checkpoint
from zerotune.checkpoint.logical import PieceReader

_logger = logging.getLogger("zerotune")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, its ``latest`` file or the tag directory does not exist (a FileNotFoundError, as
    DeepSpeed's ``zero_to_fp32`` raises for these)."""


class LazyTensor:
    """A consolidated tensor not read yet (DeepSpeed's lazy-mode handle): ``shape`` and ``dtype`` now, the values
    on ``contiguous()`` -- assembled on every call, so a caller that drops each tensor after use holds one at a time.
    Tied names share one handle."""

    def __init__(self, load: Callable[[], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._load = load
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def contiguous(self) -> torch.Tensor:
        return self._load()

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


@dataclass
class Consolidation:
    """What a checkpoint holds, by name, before any value is read."""

    directory: Path
    names: list[str]
    """Every buffer and parameter the output holds, in saving order (tied names after their owners' values)."""
    shared: dict[str, str]
    """Tied names: the further name -> the name whose values it shares."""
    handles: dict[str, LazyTensor]
    """Each name not in ``shared`` -> its values."""

    def lazy_state_dict(self) -> dict[str, LazyTensor]:
        return {name: self.handles[self.shared.get(name, name)] for name in self.names}

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each owner's tensor, read once, then under each of its tied names (same tensor object)."""
        aliases: dict[str, list[str]] = {}
        for alias, owner in self.shared.items():
            aliases.setdefault(owner, []).append(alias)
        for name in self.names:
            if name in self.shared:
                continue
            tensor = self.handles[name].contiguous()
            yield name, tensor
            for alias in aliases.get(name, []):
                yield alias, tensor


def tag_dir_of(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    """The tag directory to read: ``checkpoint_dir/tag``; with no tag, what ``latest`` names -- or ``checkpoint_dir``
    itself when it is a tag directory (zerotune's ``manifest.json`` or DeepSpeed's model-states files)."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory '{directory}' doesn't exist")
    if tag is None:
        tag = resolve_tag(directory, None)
        if tag is None:
            if (directory / MANIFEST).is_file() or any(directory.glob("*mp_rank_*_model_states.pt")):
                return directory
            raise CheckpointNotFoundError(f"unable to find the 'latest' file at {directory / 'latest'} (it names the "
                                          "tag to convert): pass the tag, or the tag directory itself")
    check_tag(str(tag))
    try:
        return tag_directory(directory, str(tag))
    except CheckpointError as error:
        raise CheckpointNotFoundError(f"{error} (tag {tag!r} of {directory})") from None


def consolidate(checkpoint_dir: str | os.PathLike, tag: str | None = None, *,
                exclude_frozen_parameters: bool = False) -> Consolidation:
    """The consolidated state dict of the checkpoint ``checkpoint_dir`` (tag: see ``tag_dir_of``), not read yet."""
    directory = tag_dir_of(checkpoint_dir, tag)
    if (directory / MANIFEST).is_file():
        return _zerotune(directory, exclude_frozen_parameters)
    if is_deepspeed_checkpoint(directory):
        return _deepspeed(directory, exclude_frozen_parameters)
    raise CheckpointError(f"{directory} is neither a zerotune checkpoint (no {MANIFEST}) nor a DeepSpeed one (no "
                          "*mp_rank_*_model_states.pt)")


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of its own: a saved view of a flat buffer would otherwise drag the whole buffer
    into every ``torch.save`` of it."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or tensor.storage_offset():
        return tensor.clone()
    return tensor


def _read_owned(reader: PieceReader, name: str) -> torch.Tensor:
    return _owned(reader.full(name))


def _stage_metadata(directory: Path, first: dict) -> dict:
    """The names a checkpoint records (trainable, buffers, tied), over all its module files: a pipeline checkpoint
    has one per stage (``model_states_stage{s}.pt``), each naming only its own layers."""
    stages = sorted(directory.glob("model_states_stage*.pt"))
    if len(stages) < 2:
        return first
    merged: dict = {"trainable_names": [], "shared_params": {}, "buffer_names": []}
    for path in stages:
        saved = read_file(path, "model states", mmap=True)
        merged["trainable_names"] += saved.get("trainable_names", [])
        merged["shared_params"].update(saved.get("shared_params") or {})
        if "buffer_names" not in saved:
            merged.pop("buffer_names", None)
        elif "buffer_names" in merged:
            merged["buffer_names"] += saved["buffer_names"]
        if "frozen_fingerprint" in saved:
            merged["frozen_fingerprint"] = saved["frozen_fingerprint"]
    return merged


def _zerotune(directory: Path, exclude_frozen: bool) -> Consolidation:
    reader, first, order = open_checkpoint(directory)
    saved = _stage_metadata(directory, first)
    shared = dict(saved.get("shared_params") or {})
    owners = [name for name in order if name not in shared]
    if "frozen_fingerprint" in saved and not exclude_frozen:
        _logger.warning("%s was saved without its frozen parameters (exclude_frozen_parameters): the consolidated "
                        "state dict holds the trained ones and the buffers only", directory)
    if exclude_frozen:
        if "buffer_names" not in saved:
            raise CheckpointError(f"{directory} was saved before zerotune recorded buffer names: its frozen parameters "
                                  "cannot be told from its buffers (convert without exclude_frozen_parameters)")
        kept = set(saved["buffer_names"]) | set(saved.get("trainable_names", []))
        owners = [name for name in owners if name in kept]
    present = set(owners)
    # a tied name stays where the module's state dict had it (stages 0-2) or follows (stage 3 saves one name)
    names = [name for name in dict.fromkeys([*order, *shared]) if shared.get(name, name) in present]
    shared = {alias: owner for alias, owner in shared.items() if alias in names}
    handles = {}
    for name in names:
        if name in shared:
            continue
        shape = reader.shape(name)
        if shape is None:
            raise CheckpointError(f"{directory} has no values for '{name}'")
        handles[name] = LazyTensor(functools.partial(_read_owned, reader, name), shape, reader.full_dtype(name))
    return Consolidation(directory, names, shared, handles)


def _deepspeed(directory: Path, exclude_frozen: bool) -> Consolidation:
    checkpoint = read_deepspeed_checkpoint(directory)
    frozen = set(checkpoint.frozen_names) if exclude_frozen else set()
    shared = {alias: owner for alias, owner in checkpoint.shared_params.items()
              if owner in checkpoint.weights and owner not in frozen}
    names = [n for n in checkpoint.weights if shared.get(n, n) not in frozen]
    weights = checkpoint.weights
    handles = {name: LazyTensor(functools.partial(weights.__getitem__, name), tuple(weights[name].shape),
                                weights[name].dtype) for name in names if name not in shared}
    return Consolidation(directory, names, shared, handles)


def write_consolidated(consolidation: Consolidation, output_dir: str | os.PathLike,
                       max_shard_bytes: int | None, safe_serialization: bool) -> list[str]:
    """Write the state dict into ``output_dir`` (created if missing) as DeepSpeed's ``zero_to_fp32`` does:
    ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), or Hugging Face shards and their
    index json when it exceeds ``max_shard_bytes`` (None: one file); the files written."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem, extension = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    writer = ShardWriter(out, max_shard_bytes if max_shard_bytes is not None else math.inf, stem, extension)
    for name, tensor in consolidation.items():
        writer.add(name, tensor)
    return writer.finish()
