"""The four collectives of tensor parallelism as autograd functions (Megatron's ``mappings.py``).

They come in conjugate pairs: what one does in forward, its partner does in backward.

* ``copy_to_tensor_parallel`` (Megatron's *f*) sits where a replicated activation enters a
  column-parallel layer. Every rank uses the same input, so forward is the identity; but each
  rank's backward only sees the gradient through its own output columns, and the true input
  gradient is their sum -- hence an all-reduce in backward.
* ``reduce_from_tensor_parallel`` (Megatron's *g*) sits where a row-parallel layer's partial
  products leave: forward sums them (all-reduce); the sum's gradient w.r.t. each addend is the
  incoming gradient itself, so backward is the identity.
* ``scatter_to_tensor_parallel`` / ``gather_from_tensor_parallel`` split or re-join an activation
  along one dim; each one's backward is the other's forward.

Each takes its process group explicitly (no global state). A group of ``None`` -- or any group of
one rank -- means tensor-parallel size 1, where all four are the identity. All collectives go
through ``zerotune.distributed.comm`` so their bytes are counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerotune.distributed import comm


def group_world_size(group: dist.ProcessGroup | None) -> int:
    """Tensor-parallel size of ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's index inside ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group into NEW storage: the input may be shared with other autograd consumers
    or be a non-contiguous view (an expanded gradient), neither of which may be written to."""
    result = tensor.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(result, group, op=comm.ReduceOp.SUM)
    return result


def _keep_own_chunk(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    world, rank = group_world_size(group), group_rank(group)
    size = tensor.shape[dim]
    if size % world != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {size} (tensor shape {tuple(tensor.shape)}) over tp size {world}: "
            f"{size} is not divisible by {world}"
        )
    chunk = size // world
    return tensor.narrow(dim, rank * chunk, chunk).contiguous()


def _gather_along(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order.

    The flat all-gather concatenates along dim 0, so move ``dim`` to the front first.
    """
    world = group_world_size(group)
    front = tensor.movedim(dim, 0).contiguous()  # (d, ...)
    gathered = front.new_empty((world * front.shape[0], *front.shape[1:]))  # (world * d, ...)
    comm.all_gather_into_tensor(gathered, front, group)
    return gathered.movedim(0, dim).contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_sum(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _keep_own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _keep_own_chunk(grad, ctx.group, ctx.dim), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) of the gradient over the tp group (Megatron's f)."""
    if group_world_size(group) == 1:
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: all-reduce (sum) into a new tensor (``x`` is untouched). Backward: identity (Megatron's g)."""
    if group_world_size(group) == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Forward: keep this rank's chunk of ``x`` along ``dim``. Backward: all-gather the gradient along ``dim``."""
    if group_world_size(group) == 1:
        return x
    return _ScatterToTensorParallel.apply(x, group, dim % x.dim())


def gather_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather ``x`` along ``dim`` (rank order). Backward: keep this rank's chunk of the gradient."""
    if group_world_size(group) == 1:
        return x
    return _GatherFromTensorParallel.apply(x, group, dim % x.dim())
