"""Reduce-scatter several tensors in one collective, each rank keeping its partition of each.

Why one collective: a reduce-scatter per tensor pays the launch and synchronisation cost once per
tensor, which dominates for the many small gradients of a ZeRO-3 unit. Here every tensor is split
by the same partition math as ZeRO's flat buffers (``partition.flat_layout`` with one entry: rank r
owns ``[r * shard, (r + 1) * shard)``, ``shard = ceil(numel / world)``), the pieces are interleaved
rank by rank into one buffer padded per tensor, and a single counted reduce-scatter through
``zerotune.distributed.comm`` leaves each rank the buffer holding its partition of every tensor:

    buffer: | t0 part r0 | t1 part r0 |pad| t0 part r1 | t1 part r1 |pad| ...
              <------- rank 0's ------->   <------- rank 1's ------->

The result is the average over ranks (the buffer is divided by the group size before the sum), as
DeepSpeed's ``reduce_scatter_coalesced``: a gradient reduce wants the mean. A rank whose partition of
a tensor is empty (a tensor smaller than the group) gets an empty tensor for it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.zero.partition import FlatLayout, flat_layout


def _layouts(tensors: Sequence[torch.Tensor], world: int) -> list[FlatLayout]:
    return [flat_layout([tensor.numel()], world) for tensor in tensors]


def _interleave(tensors: Sequence[torch.Tensor], layouts: list[FlatLayout], world: int) -> torch.Tensor:
    """One flat buffer: for each rank in order, each tensor's partition for that rank padded to its shard."""
    if len(tensors) == 1 and tensors[0].numel() == layouts[0].padded:
        return tensors[0].reshape(-1).clone()  # no padding needed; the copy keeps the caller's tensor intact
    reference = tensors[0]
    buffer = torch.zeros(world * sum(layout.shard for layout in layouts), dtype=reference.dtype,
                         device=reference.device)
    offset = 0
    for rank in range(world):
        for tensor, layout in zip(tensors, layouts):
            flat = tensor.reshape(-1)
            for piece in layout.owned_pieces(rank):
                buffer[offset + piece.flat_offset - rank * layout.shard:][:piece.length].copy_(
                    flat[piece.param_offset:piece.param_offset + piece.length])
            offset += layout.shard
    return buffer


def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Average ``tensors`` over ``group`` and return this rank's partition of each (flat; views into one buffer).

    ``group`` is the explicit process group (``None``: an axis of size 1, every tensor is its own partition).
    The tensors must share a dtype and device (they travel in one buffer)."""
    if not tensors:
        return []
    dtypes = {(tensor.dtype, tensor.device) for tensor in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"reduce_scatter_coalesced: the tensors must share one dtype and device, got "
                         f"{sorted(str(d) for d in dtypes)}")
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    layouts = _layouts(tensors, world)
    buffer = _interleave(tensors, layouts, world)
    buffer.div_(world)  # pre-divide: the sum of the divided parts is the mean
    output = buffer.new_empty(buffer.numel() // world)  # (sum of shards,): this rank's part of every tensor
    comm.reduce_scatter_tensor(output, buffer, group)
    results, offset = [], 0
    for layout in layouts:
        length = sum(piece.length for piece in layout.owned_pieces(rank))
        results.append(output.narrow(0, offset, length))
        offset += layout.shard
    return results
