"""The global gradient norm, from whatever part of the gradients this rank holds.

One function for every layout, so clipping and the fp16 overflow check agree on all ranks:

* ZeRO 1-3 hold disjoint slices over the data-parallel (``dp_sp``) ranks: their squares are
  summed over that group;
* model parallelism holds different parameters on the tp and pp ranks (``model_groups``): their
  squares are summed over those groups too. Some parameters are replicated there -- tp-replicated
  LayerNorms and row biases, a weight tied between the first and last pipeline stage -- and
  hold the same gradient on each holder, so only one holder counts them (Megatron does the same);
  ``skip`` gives, per gradient tensor, the flat ranges this rank leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm

Ranges = Sequence[tuple[int, int]]


def _counted_parts(grad: torch.Tensor, skip: Ranges) -> list[torch.Tensor]:
    """``grad`` (flattened) without the ``skip`` ranges (sorted, possibly past the end)."""
    flat = grad.reshape(-1)
    parts, position = [], 0
    for lo, hi in sorted(skip):
        lo, hi = min(lo, flat.numel()), min(hi, flat.numel())
        if lo > position:
            parts.append(flat[position:lo])
        position = max(position, hi)
    if position < flat.numel():
        parts.append(flat[position:])
    return parts


def global_grad_norm(grads: Sequence[torch.Tensor], *, shard_group: dist.ProcessGroup | None = None,
                     model_groups: Sequence[dist.ProcessGroup] = (),
                     skip: Sequence[Ranges] | None = None) -> float:
    """L2 norm of the whole model's gradient; ``inf`` when any part is not finite.

    Per-part norms in fp32 (cascaded sums: accurate), squared and summed in fp64; one part at a
    time, so gradients still in bf16 (NVMe offload) are converted one part at a time.
    """
    parts = list(grads) if skip is None else [p for g, s in zip(grads, skip) for p in _counted_parts(g, s)]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    parts = [p for p in parts if p.numel()]
    if parts:
        squares += torch.stack([torch._foreach_norm([p.float()])[0] for p in parts]).double().pow(2).sum()
    comm.all_reduce(squares, shard_group)
    for group in model_groups:
        comm.all_reduce(squares, group)
    total = squares.item()
    return math.sqrt(total) if math.isfinite(total) else float("inf")


@dataclass(frozen=True)
class ModelParallelNorm:
    """The norm also sums over ``groups`` (tp, pp); parameters for which ``counted_here`` is False are counted
    by another holder (tp-replicated LayerNorms on tp rank 0, a tied weight on its first stage)."""

    groups: tuple
    counted_here: Callable[[torch.nn.Parameter], bool]


def clip_grads_to_norm_(params: Sequence[torch.nn.Parameter], max_norm: float, *,
                        model_norm: ModelParallelNorm | None = None,
                        rank_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so their global L2 norm is at most ``max_norm``; return that
    norm before clipping, a float32 tensor on the first gradient's device (``inf`` when not finite).

    For scripts that clip outside the engine (DeepSpeed's ``runtime.utils.clip_grad_norm_``); the engine clips
    within its own step. The norm is ``global_grad_norm``'s, summed over ``model_norm``'s groups (each rank
    holds its own parameters there; a replicated one is counted where ``counted_here`` says). ``rank_group``
    holds ranks whose gradients may differ (expert parameters, gradients not yet reduced) and must still clip
    by one factor: they share the root mean square of their norms, as the engine does for per-rank gradients,
    which is each rank's own norm when they hold the same gradients.

    The factor is ``torch.nn.utils.clip_grad_norm_``'s (``max_norm / (norm + 1e-6)`` in fp32, at most 1), so
    one process clips exactly as torch does. Every rank of the groups must call it (collectives).
    """
    counted_here = model_norm.counted_here if model_norm is not None else None
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and (counted_here is None or counted_here(p))]
    norm = global_grad_norm(counted, shard_group=rank_group, model_groups=model_norm.groups if model_norm else ())
    if rank_group is not None:
        norm /= math.sqrt(dist.get_world_size(rank_group))
    total = torch.tensor(norm, dtype=torch.float32, device=grads[0].device if grads else torch.device("cpu"))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device))
    return total
