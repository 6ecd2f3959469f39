"""A param group's trainable parameters as views of one padded flat buffer.

ZeRO stages 1 and 2 update only this rank's slice of every parameter, then all-gather the
slices. With the parameters living in one flat buffer (in ``partition.FlatLayout`` order), the
all-gather writes straight into the model's parameters -- no unpacking -- and in fp32 the
optimizer's "master" slice is simply a view of that buffer, so no second copy exists.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.zero.partition import FlatLayout, flat_layout


class FlatParamGroup:
    """Re-points each parameter's ``.data`` at its place in a flat, evenly shardable buffer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], world: int, rank: int,
                 dtype: torch.dtype | None = None) -> None:
        """``dtype``: the model's parameter dtype (values are cast into the buffer)."""
        self.params = list(params)
        self.layout: FlatLayout = flat_layout([p.numel() for p in self.params], world)
        self.rank = rank
        first = self.params[0] if self.params else None
        dtype = dtype or (first.dtype if first is not None else torch.float32)
        device = first.device if first is not None else torch.device("cpu")
        self.buffer = torch.zeros(self.layout.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(self.params, self.layout.offsets):
                view = self.buffer[offset:offset + param.numel()]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view(param.shape)

    @property
    def owned(self) -> torch.Tensor:
        """This rank's slice of the flat buffer (a view)."""
        start, end = self.layout.owned_range(self.rank)
        return self.buffer[start:end]

    def chunks(self, chunk_numel: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` offsets inside a shard, at most ``chunk_numel`` long: the unit of one bucketed collective."""
        shard = self.layout.shard
        step = max(1, min(chunk_numel, shard))
        return [(lo, min(lo + step, shard)) for lo in range(0, shard, step)]

    def rank_views(self, tensor: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
        """``[lo, hi)`` of every rank's shard of a flat tensor laid out like this group."""
        shard = self.layout.shard
        return [tensor[r * shard + lo:r * shard + hi] for r in range(self.layout.world)]

    def all_gather(self, group: dist.ProcessGroup | None, bucket_numel: int) -> None:
        """Give every rank every rank's updated slice, ``bucket_numel`` elements per rank at a time."""
        handles = []
        for lo, hi in self.chunks(bucket_numel):
            outputs = self.rank_views(self.buffer, lo, hi)
            handles.append(comm.all_gather(outputs, outputs[self.rank], group, async_op=True))
        for handle in handles:
            handle.wait()

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
