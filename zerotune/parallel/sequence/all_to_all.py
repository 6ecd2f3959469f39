"""The one collective of Ulysses sequence parallelism: a differentiable all-to-all that trades a
split along one dimension for a split along another.

Inside attention, q/k/v arrive split by sequence ([b, h, s/P, d] on each of P ranks) and must be
split by heads instead ([b, h/P, s, d]), so that the model's own attention kernel sees the whole
sequence for its share of heads; the output goes the opposite way. Both are the same operation
with the two dimensions swapped, and its gradient is that operation reversed, so one autograd
Function covers the forward and the backward of both directions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotune.distributed import comm


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk r of ``x`` along scatter_dim goes to rank r; what every rank sent is concatenated along
    gather_dim in rank order. One flat all_to_all_single on a dim-0 stack of the chunks, because
    that is the only all-to-all every backend (gloo included) implements efficiently."""
    size = _group_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"seq_all_to_all: dimension {scatter_dim} of a tensor of shape {tuple(x.shape)} has size "
            f"{x.shape[scatter_dim]}, which does not split into {size} equal parts (one per sequence-parallel rank)"
        )
    if size == 1:
        return x
    send = torch.stack(x.chunk(size, dim=scatter_dim), dim=0).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The inverse exchange routes every gradient chunk back to the rank (and place) it came from.
        return seq_all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into P equal chunks along ``scatter_dim``, send chunk r to rank r of ``group``, and
    concatenate the P received chunks along ``gather_dim`` in rank order. Differentiable; a group of
    None (sequence-parallel size 1) returns ``x`` unchanged. Negative dims are accepted."""
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if scatter_dim == gather_dim:
        raise ValueError(f"seq_all_to_all: scatter_dim and gather_dim must differ, both are {scatter_dim}")
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)
