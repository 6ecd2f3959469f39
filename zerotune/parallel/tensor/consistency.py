"""Every rank of a tensor-parallel group must run the same batch: checked once, at the engine's first forward.

The ranks of a tp group hold pieces of one model and combine their partial activations; fed different samples,
they silently train on a mix of them. A data loader that shards by global rank (not by data-parallel rank) is
the usual cause, so the engine compares the first forward's inputs across the group -- one small object
all-gather of per-tensor fingerprints through ``zerotune.distributed.comm`` -- and fails on every rank alike
with DeepSpeed's message (its engine checks the same, once, in a forward pre-hook).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from zerotune.distributed import comm

INCONSISTENT_MESSAGE = ("Data inconsistency within the TP group. Please check the Dataloader implementation to "
                        "ensure consistency.")


class TensorParallelDataMismatch(AssertionError):
    """The ranks of a tensor-parallel group got different inputs (an AssertionError, as DeepSpeed's check)."""


def _fingerprint(value: Any) -> Any:
    """A comparable summary of a nested batch: tensors by shape, dtype and a digest of their bytes."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        return ("tensor", tuple(data.shape), str(data.dtype), digest)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_fingerprint(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(key), _fingerprint(item)) for key, item in sorted(value.items(), key=str)))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return ("value", repr(value))
    return ("object", type(value).__qualname__)  # (another object's repr may hold its address: not compared)


def check_same_inputs(args: tuple, kwargs: dict, group: dist.ProcessGroup | None) -> None:
    """Raise ``TensorParallelDataMismatch`` on every rank of ``group`` unless all passed equal inputs."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = _fingerprint((args, kwargs))
    everyone = comm.all_gather_object(mine, group)
    if any(theirs != everyone[0] for theirs in everyone):
        raise TensorParallelDataMismatch(INCONSISTENT_MESSAGE)
