"""ZeRO stage 0 gradient sync: plain data parallel, bucketed all-reduce overlapped with backward.

Where gradients live and in what dtype: every trainable parameter's gradient has a slot in an
**fp32** flat bucket buffer, so accumulation over micro-steps happens in fp32 whatever the model
dtype. For fp32 parameters ``param.grad`` *is* that slot (a view attached before each backward),
and autograd accumulates into the bucket in place -- no copy, no extra allocation (DDP's
``gradient_as_bucket_view``). For bf16/fp16 parameters autograd writes ``param.grad`` in the
parameter's dtype; a post-accumulate hook adds it into the fp32 slot and drops it at once, so
such a model holds no full-size low-precision gradient between micro-steps.

Only the last micro-step of an accumulation window (the boundary) communicates: as each bucket
fills up during that backward, its all-reduce is launched asynchronously, so communication
overlaps the rest of backward. ``finish()`` launches what never filled (parameters that got no
gradient), waits, and rescales the sums to means.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm, compression
from zerotune.distributed.buckets import Bucket, GradientBuckets
from zerotune.distributed.streams import phase, streams_for
from zerotune.zero.contracts import TiedWeight
from zerotune.zero.grad_hooks import register_grad_ready_hooks


class AllReduceGradSync:
    """Keeps the data-parallel replicas' gradients identical (and averaged) at every boundary."""

    reduces_every_backward = False

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None, *,
                 bucket_numel: int, device: torch.device, predivide_factor: float = 1.0,
                 compressor: compression.TopKCompressor | None = None, comm_dtype: torch.dtype | None = None) -> None:
        self.params = list(params)
        self.comm_dtype = comm_dtype  # communication_data_type: the buckets are all-reduced in it
        self.group = group
        world = 1 if group is None else dist.get_world_size(group)
        # Sum(g / pre) * pre / world == mean(g); pre > 1 keeps fp16/bf16 sums in range.
        self.pre_factor = float(predivide_factor)
        self.post_factor = self.pre_factor / world
        self.buckets = GradientBuckets.whole_params(self.params, bucket_numel, torch.float32, device, self._launch)
        self._handles: list[tuple[comm.Handle, torch.Tensor, torch.Tensor]] = []  # (handle, bucket, on the wire)
        self._communicating = False
        self._settled = False  # the boundary's all-reduce was finished ahead of the step (``settle``)
        self._grads_in_buckets = all(p.dtype == torch.float32 for p in self.params)
        self._hooks = register_grad_ready_hooks(self.params, self._on_grad_ready)
        self.compressor = compressor  # Top-K gradient compression of the all-reduce (gradient_compression)
        self.local_only = False
        """Each rank keeps its own gradient (no all-reduce): see ``use_local_gradients``."""

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Call before each backward: only the boundary micro-step communicates."""
        self._communicating = is_boundary
        self._settled = False
        if is_boundary:
            self.buckets.start_round()
            self._handles = []
        if self._grads_in_buckets:
            for param in self.params:
                if param.grad is None:
                    param.grad = self.buckets.view_of(param)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        view = self.buckets.view_of(param)
        grad = param.grad
        assert grad is not None  # a post-accumulate-grad hook runs once autograd has written the gradient
        if grad.data_ptr() != view.data_ptr():
            if self._grads_in_buckets:  # autograd replaced the view (e.g. create_graph=True): take its sum
                view.copy_(grad)
                param.grad = view
            else:
                view.add_(grad)
                param.grad = None
        if self._communicating:
            self.buckets.mark_ready(param)

    def _launch(self, bucket: Bucket) -> None:
        if self.local_only:
            return
        buffer = bucket.ensure_buffer()  # (persistent: allocated with the bucket)
        # on the reduce stream, behind the backward that filled the bucket; the backward goes on meanwhile
        with phase("reduce"), streams_for(buffer.device).on("reduce"):
            if self.pre_factor != 1.0:
                buffer.div_(self.pre_factor)
            if self.compressor is not None:
                handle = compression.all_reduce(buffer, self.group, self.compressor,
                                                f"all_reduce.{bucket.index}", async_op=True)
                self._handles.append((handle, buffer, buffer))
            else:
                wire = comm.on_the_wire(buffer, self.comm_dtype)
                self._handles.append((comm.all_reduce(wire, self.group, async_op=True), buffer, wire))

    def finish(self, ties: Sequence[TiedWeight] = ()) -> None:
        """Complete the boundary's communication; afterwards every bucket holds the mean gradient, and each tied
        weight's mean summed over the pipeline stages holding it (summing and averaging commute)."""
        if self._settled:  # (done already, by ``settle``)
            self._settled = False
        else:
            self._complete()
        for param, group in ties:
            comm.all_reduce(self.grad_of(param), group)

    def _complete(self) -> None:
        self.buckets.launch_remaining()
        buffers = [bucket.ensure_buffer() for bucket in self.buckets.buckets]
        if buffers:
            streams = streams_for(buffers[0].device)
            with phase("reduce"), streams.on("reduce"):
                for handle, buffer, wire in self._handles:
                    handle.wait()
                    if wire is not buffer:
                        buffer.copy_(wire)
                if self.post_factor != 1.0 and not self.local_only:
                    for buffer in buffers:
                        buffer.mul_(self.post_factor)
            streams.join("reduce")  # the step reads the buckets next
        self._handles = []
        self._communicating = False

    def settle(self) -> None:
        """Between a boundary backward and the step: finish the all-reduce now, so the gradients read (or written)
        are the means the step uses; the step's ``finish`` then has nothing left to do. Otherwise nothing."""
        if self._communicating:
            self.finish()
            self._settled = True

    def whole_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Every rank holds every gradient whole: the mean after a settled boundary, else this rank's own sum."""
        return self.grad_of(param)

    def wait_in_flight(self) -> None:
        """Wait for the all-reduces launched so far (they write into the buckets) without ending the round:
        ``finish`` still launches the rest and rescales (``engine.offload_states`` between backward and step)."""
        for handle, _, _ in self._handles:
            handle.wait()

    def use_local_gradients(self, enabled: bool) -> None:
        """An optimizer that averages something else (OneBitAdam's momentum, after its warm-up) takes each
        rank's own gradient: from now on the boundary all-reduce is skipped."""
        self.local_only = bool(enabled)

    def grad_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 gradient of ``param`` (a view into its bucket)."""
        return self.buckets.view_of(param)

    def zero_grad(self) -> None:
        self.buckets.zero_()
        for p in self.params:
            p.grad = None

    def grad_bytes(self) -> int:
        """The fp32 buckets *are* the gradient storage."""
        return sum(buffer.numel() * buffer.element_size()
                   for buffer in (b.ensure_buffer() for b in self.buckets.buckets))

    def buffer_bytes(self) -> int:
        """No communication buffers beyond the gradients themselves."""
        return 0

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
