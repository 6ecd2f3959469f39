"""Whole tensors from tensor-parallel shards: what checkpoints and exports need so a saved model does
not depend on the tensor-parallel size it was trained with.

``model_states.pt`` and ``save_16bit_model`` hold full tensors under the model's own keys (an HF
``from_pretrained`` reads them unchanged); loading cuts each full tensor to this rank's piece by its
layout (``checkpoint/logical.py``).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.parallel.tensor.layout import tp_layout_of, unshard_tensor


def full_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the full tensor ``tensor`` is a shard of (its own shape when replicated)."""
    layout = tp_layout_of(tensor)
    if layout is None:
        return tensor.shape
    shape = list(tensor.shape)
    shape[layout.dim % tensor.dim()] = layout.full_size
    return torch.Size(shape)


def gather_full_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor from every tp rank's shard (a collective over ``group``); replicated ones as they are."""
    layout = tp_layout_of(tensor)
    if layout is None or group is None:
        return tensor.detach()
    local = tensor.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(layout.world)]
    comm.all_gather(shards, local, group)
    return unshard_tensor(shards, layout)


def iter_full_tensors(items: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, full tensor)`` for each ``(key, live tensor)``; every rank of ``group`` must iterate alike."""
    for key, tensor in items:
        yield key, gather_full_tensor(tensor, group)

