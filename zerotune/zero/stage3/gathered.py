"""``GatheredParameters``: whole parameters outside forward, as DeepSpeed's context of that name.

Inside the block every listed parameter that ZeRO-3 partitioned holds its full values on every
rank. On exit, with ``modifier_rank`` set, that rank's (possibly modified) values are broadcast
and written back into every rank's shard -- and into the fp32 masters when training in mixed
precision -- so a change made there is what training continues from. With ``modifier_rank=None``
the block is read-only: changes are discarded. Units gathered before the block stay gathered, and so do
units whose gather was in flight (a prefetch): the block waited for it, and the schedule releases them as planned.
"""

from __future__ import annotations

from typing import Iterable, cast

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.zero.stage3.segment import FlatSegment
from zerotune.zero.stage3.sharded_param import sharded_param_of


def _segments_of(params: torch.Tensor | Iterable[torch.Tensor]) -> list[FlatSegment]:
    if isinstance(params, torch.Tensor):
        params = [params]
    segments: dict[int, FlatSegment] = {}
    for param in params:
        sharded = sharded_param_of(param)
        if sharded is not None:  # (a sharded parameter's segment is the FlatSegment that made it)
            segments.setdefault(id(sharded.segment), cast(FlatSegment, sharded.segment))
    return list(segments.values())


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0): ...`` -- see the module docstring."""

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 fwd_module: torch.nn.Module | None = None, enabled: bool = True) -> None:
        del fwd_module  # DeepSpeed registers external parameters with it; units here need no registration
        self.segments = _segments_of(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._was_gathered: list[bool] = []

    def __enter__(self) -> "GatheredParameters":
        self._was_gathered = [segment.gathered or segment.in_flight for segment in self.segments]
        for segment in self.segments:
            segment.start_gather()
        for segment in self.segments:
            segment.finish_gather()
        return self

    @torch.no_grad()
    def __exit__(self, *exc_info: object) -> None:
        for segment, was_gathered in zip(self.segments, self._was_gathered):
            if self.modifier_rank is not None and exc_info[0] is None:
                group = segment.group
                source = self.modifier_rank if group is None else dist.get_group_rank(group, self.modifier_rank)
                comm.broadcast(segment.full, source, group)
                start, end = segment.layout.owned_range(segment.rank)
                segment.overwrite_local(segment.full[start:end])
            if not was_gathered:
                segment.release()
