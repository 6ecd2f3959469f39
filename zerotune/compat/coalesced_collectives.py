"""``deepspeed.runtime.comm.coalesced_collectives``: DeepSpeed's batched reduce-scatter on zerotune's.

``reduce_scatter_coalesced(tensors, group=None)`` is ``zerotune.zero.coalesced``'s (one counted collective through
zerotune's collective layer), with DeepSpeed's default of the world for ``group``. ``all_to_all_quant_reduce`` is
ZeRO++'s quantized gradient all-to-all (qgZ), which needs DeepSpeed's CUDA quantizer kernels: refused when called.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.compat.comm import get_world_group
from zerotune.compat.refusals import refused_function
from zerotune.zero.coalesced import reduce_scatter_coalesced as _reduce_scatter_coalesced

__all__ = ["reduce_scatter_coalesced", "all_to_all_quant_reduce"]

all_to_all_quant_reduce = refused_function("deepspeed.runtime.comm.coalesced_collectives.all_to_all_quant_reduce")


def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor],
                             group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Average ``tensors`` over ``group`` (default: the world) in one reduce-scatter; this rank's partition of
    each, flat (rank r holds elements ``[r * ceil(n / world), (r + 1) * ceil(n / world))`` of a tensor of n)."""
    return _reduce_scatter_coalesced(tensors, group if group is not None else get_world_group())
