"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's pluggable checkpoint-file writer API over zerotune's writes.

Why a thin class: DeepSpeed's engine hands every checkpoint file to a ``CheckpointEngine`` (``create`` a tag,
``save`` / ``load`` files, ``commit`` the tag). zerotune's engine writes its checkpoints itself, through
``zerotune.checkpoint.atomic`` (temporary name, fsync, rename; a manifest of SHA-256 digests published last), so
``TorchCheckpointEngine`` here is that same writer under DeepSpeed's method names, for code that saves its own
files through a checkpoint engine (a pipeline module's layers, a client's extra state). Every ``save`` is complete
and durable when it returns, so ``commit`` has nothing left to flush. Files load with ``weights_only=True``
(zerotune's trust rule: tensors, numbers, strings and containers only), and are always written in torch's zipfile
format (DeepSpeed's ``checkpoint.checkpoint_serialization: false`` legacy format is not written).
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.checkpoint.atomic import read_file, write_file_atomically

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]


@dataclass
class CheckpointCommitInfo:
    """Which checkpoint a ``create`` / ``commit`` call is about (DeepSpeed's record)."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """DeepSpeed's checkpoint writer interface: ``create`` / ``save`` / ``load`` / ``commit`` (+ ``makedirs``)."""

    def __init__(self, config_params: Any = None) -> None:
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None:
        """A checkpoint ``info.tag`` is about to be saved."""

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path``."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        """Read what ``save`` wrote to ``path``."""

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of ``info.tag`` is saved; True once it is durable."""

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether data-parallel rank ``dp_rank`` writes the replicated files (the first replica, as DeepSpeed's)."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether saves finish in the background (never here: every save is done when it returns)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        """Only a decoupled engine keeps the commit info until its background writes end."""
        del info

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:
        """Nothing is left to release: no background writer, no open files."""
        return None

    def preserves_storage_sharing(self) -> bool:
        """``torch.save`` keeps views of one storage as views (clone them to save only their own values)."""
        return True


class TorchCheckpointEngine(CheckpointEngine):
    """Files written by ``torch.save`` the way zerotune writes its own checkpoint files (``checkpoint/atomic.py``):
    to a temporary name, fsync'd, then renamed over ``path``, so a crash never leaves a half-written file."""

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = "TorchCheckpointEngine"

    def create(self, info: CheckpointCommitInfo) -> None:
        """No staging is needed: each file is published by its own atomic rename."""

    def save(self, state_dict: Any, path: str) -> None:
        write_file_atomically(state_dict, Path(path))

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load(weights_only=True)``; a missing or refused file raises ``CheckpointError`` naming it."""
        return read_file(Path(path), "checkpoint engine file", map_location=map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True
