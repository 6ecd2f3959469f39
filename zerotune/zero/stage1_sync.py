"""ZeRO stage 1 gradient sync: accumulate full gradients locally, reduce-scatter at the boundary.

Each rank keeps a full-size gradient buffer per param group in the parameters' dtype, laid out
like the group's flat parameters; ``param.grad`` is a view of it, so autograd accumulates
micro-steps in place. Nothing is communicated until the accumulation boundary. There, one
reduce-scatter per bucket (``reduce_bucket_size`` elements of each rank's slice) leaves every
rank the summed gradient of the slice it owns -- the only part its optimizer shard needs. The
rest of the buffer is scratch until ``zero_grad``.

Memory: 2 bytes/param of gradient in bf16 (4 in fp32) on every rank, as in the ZeRO paper's
stage-1 formula; optimizer state and fp32 masters are sharded by ``ShardedState``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm, compression
from zerotune.distributed.streams import phase, streams_for
from zerotune.zero.contracts import TiedWeight
from zerotune.zero.flat_params import FlatParamGroup


class ReduceAtBoundaryGradSync:
    """Full local gradients; one bucketed reduce-scatter per optimizer step."""

    reduces_every_backward = False

    def __init__(self, flat_groups: Sequence[FlatParamGroup], group: dist.ProcessGroup | None, *,
                 bucket_numel: int, predivide_factor: float = 1.0,
                 compressor: compression.TopKCompressor | None = None, comm_dtype: torch.dtype | None = None) -> None:
        self.flat_groups = list(flat_groups)
        self.comm_dtype = comm_dtype  # communication_data_type: the gradients are reduce-scattered in it
        self.group = group
        world = 1 if group is None else dist.get_world_size(group)
        self.pre_factor = float(predivide_factor)
        self.post_factor = self.pre_factor / world
        self.bucket_numel = bucket_numel
        self.grad_buffers = [torch.zeros_like(fg.buffer) for fg in self.flat_groups]
        self._views = [
            [buffer[offset:offset + p.numel()].view(p.shape) for p, offset in zip(fg.params, fg.layout.offsets)]
            for fg, buffer in zip(self.flat_groups, self.grad_buffers)
        ]
        self.compressor = compressor  # Top-K gradient compression of the reduce-scatter (gradient_compression)
        self._due = False  # a boundary backward ran: its reduce-scatter is due
        self._reduced = False  # the buffers' owned slices hold the means (the rest is scratch) until zero_grad

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Point every ``param.grad`` at its slot so autograd accumulates into the flat buffer."""
        self._due, self._reduced = is_boundary, False
        for fg, views in zip(self.flat_groups, self._views):
            for param, view in zip(fg.params, views):
                if param.grad is None:
                    param.grad = view

    def finish(self, ties: Sequence[TiedWeight] = ()) -> None:
        """Reduce-scatter each group's gradients; afterwards ``shard_grad(g)`` is this rank's mean gradient. A tied
        weight's gradient is summed over the pipeline stages holding it first, while every rank holds it whole
        (in ``param.grad``); summing and averaging commute."""
        if ties and self._reduced:
            raise RuntimeError("ZeRO stage 1: tied weights' gradients must be summed before the reduce-scatter, "
                               "which settle() already ran")
        for param, group in ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            comm.all_reduce(param.grad, group)
        if self._reduced:  # (done already: ``settle`` ran ahead of the step)
            return
        self._due, self._reduced = False, True
        handles = []
        for fg, _buffer, views in zip(self.flat_groups, self.grad_buffers, self._views):
            for param, view in zip(fg.params, views):
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)  # autograd replaced the view (e.g. create_graph=True)
                    param.grad = view
        streams = streams_for(self.grad_buffers[0].device) if self.grad_buffers else None
        if streams is None:
            return
        with phase("reduce"), streams.on("reduce"):
            wires = []
            for index, (fg, buffer) in enumerate(zip(self.flat_groups, self.grad_buffers)):
                if self.pre_factor != 1.0:
                    buffer.div_(self.pre_factor)
                wire = buffer if self.compressor is not None else comm.on_the_wire(buffer, self.comm_dtype)
                wires.append(wire)
                for lo, hi in fg.chunks(self.bucket_numel):
                    inputs = fg.rank_views(wire, lo, hi)
                    if self.compressor is not None:
                        handles.append(compression.reduce_scatter(inputs[fg.rank], inputs, self.group,
                                                                  self.compressor, f"reduce_scatter.{index}.{lo}",
                                                                  async_op=True))
                    else:
                        handles.append(comm.reduce_scatter(inputs[fg.rank], inputs, self.group, async_op=True))
            for handle in handles:
                handle.wait()
            for g, (buffer, wire) in enumerate(zip(self.grad_buffers, wires)):
                if wire is not buffer:  # this rank's reduced slice back into the gradient buffer
                    start, end = self.flat_groups[g].layout.owned_range(self.flat_groups[g].rank)
                    buffer[start:end].copy_(wire[start:end])
            if self.post_factor != 1.0:
                for g in range(len(self.flat_groups)):
                    self.shard_grad(g).mul_(self.post_factor)
        streams.join("reduce")

    def settle(self) -> None:
        """Between a boundary backward and the step: reduce-scatter now, so the gradients read (or written) are the
        means the step uses; the step's ``finish`` then has nothing left to do. Otherwise nothing."""
        if self._due:
            self.finish()

    def whole_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Before the boundary's reduce-scatter each rank holds its own whole sum of ``param``'s gradient; after
        it, only ``shard_grad`` is a mean (the rest of the buffer is scratch): None."""
        if self._reduced:
            return None
        return next(view for fg, views in zip(self.flat_groups, self._views)
                    for p, view in zip(fg.params, views) if p is param)

    def shard_grad(self, group_index: int) -> torch.Tensor:
        """This rank's slice of group ``group_index``'s gradient (valid after ``finish``)."""
        fg = self.flat_groups[group_index]
        start, end = fg.layout.owned_range(fg.rank)
        return self.grad_buffers[group_index][start:end]

    def zero_grad(self) -> None:
        self._reduced = False
        for buffer in self.grad_buffers:
            buffer.zero_()
        for fg in self.flat_groups:
            for param in fg.params:
                param.grad = None

    def grad_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.grad_buffers)

    def buffer_bytes(self) -> int:
        return 0

    def remove_hooks(self) -> None:
        """No hooks: gradients land in the buffer through ``param.grad`` views."""
