"""One communication unit: a module's parameters that are gathered, released and reduced together.

A unit is typically a transformer block. Its trainable and frozen parameters are two separate
``FlatSegment``s, so frozen weights (LoRA's base model) never cost gradient communication.
Trainable parameters are ordered by optimizer group, so each group's part of a rank's shard is
contiguous: one master view per unit and group.

Gradients: as each trainable parameter's gradient is accumulated, it is added into a full-size
flat gradient buffer that exists only during the unit's backward, and ``param.grad`` is dropped.
When the unit's backward is over, the buffer is reduce-scattered (one collective per unit) and
this rank's slice is added, scaled by 1/N, into ``grad_shard`` -- in the segment's dtype,
accumulated across micro-steps (stage 2 does the same) -- and the buffer is freed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.distributed.streams import DeferredRelease, phase, streams_for
from zerotune.zero.stage3.segment import FlatSegment


class BufferPool:
    """Recycled flat buffers for the units' transient gradients, shared by all units.

    On CPU a fresh multi-MiB buffer is a fresh ``mmap``: zero-filled pages faulted in one by one,
    which costs more than the copies themselves. Gradient buffers live only while a unit's
    backward and reduce-scatter run, so a few recycled ones serve every unit. The free ones kept
    total at most ``capacity_numel`` elements (``reduce_bucket_size``: the stage-3 counterpart of
    the reduce buckets stages 1 and 2 keep). On CUDA a buffer the reduce stream used comes back only
    once that use is over (``give(buffer, after=event)``).
    """

    def __init__(self, capacity_numel: int) -> None:
        self.capacity_numel = capacity_numel
        self._free: list[torch.Tensor] = []
        self._returning: DeferredRelease[torch.Tensor] = DeferredRelease(self._keep)

    def take(self, numel: int, like: torch.Tensor, zero: bool) -> torch.Tensor:
        self._returning.poll()
        fits = [i for i, t in enumerate(self._free)
                if t.numel() >= numel and t.dtype == like.dtype and t.device == like.device]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))[:numel]
            return buffer.zero_() if zero else buffer
        return (torch.zeros if zero else torch.empty)(numel, dtype=like.dtype, device=like.device)

    def give(self, buffer: torch.Tensor, after: object = None) -> None:
        """Keep ``buffer`` for reuse once ``after`` (an event on the stream that used it last; None: now) passed."""
        self._returning.later(buffer if buffer._base is None else buffer._base, after)

    def _keep(self, whole: torch.Tensor) -> None:
        kept = sum(t.numel() for t in self._free)
        if kept + whole.numel() <= self.capacity_numel:
            self._free.append(whole)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self._free, *self._returning.waiting()])

    def clear(self) -> int:
        """Free the buffers kept for reuse (taken anew when needed); returns their bytes (``engine.offload_states``)."""
        self._returning.poll()
        freed = sum(t.numel() * t.element_size() for t in self._free)
        self._free.clear()
        return freed


class ParamUnit:
    """The segments of one unit and the gather / release / gradient-reduce steps on them."""

    def __init__(self, name: str, module: torch.nn.Module, trainable: Sequence[torch.nn.Parameter],
                 frozen: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None, *,
                 persistent: bool = False, is_root: bool = False, buffers: BufferPool | None = None,
                 shard_device: torch.device | None = None, pin_memory: bool = False) -> None:
        self.name = name
        self.module = module
        self.group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.persistent = persistent
        """Small units stay gathered between uses (re-gathered once per optimizer step)."""
        self.is_root = is_root
        """The root unit stays gathered from its forward to the end of backward (used first and last)."""
        def segment(params: Sequence[torch.nn.Parameter]) -> FlatSegment | None:
            return (FlatSegment(params, group, local_device=shard_device, pin_memory=pin_memory, persistent=persistent)
                    if params else None)

        self.trainable = segment(trainable)
        self.frozen = segment(frozen)
        self.segments = [s for s in (self.trainable, self.frozen) if s is not None]
        self.grad_shard: torch.Tensor | None = None
        self.buffers = buffers or BufferPool(capacity_numel=0)
        self._offset_of = ({id(p): (o, p.numel()) for p, o in zip(self.trainable.params, self.trainable.layout.offsets)}
                           if self.trainable else {})
        self._grad_full: torch.Tensor | None = None
        self._grads_seen: set[int] = set()
        self._in_flight: tuple[comm.Handle, torch.Tensor, torch.Tensor] | None = None
        self.reduced = False
        """Whether this micro-step's gradients were already reduce-scattered."""

    # ---- parameters ----------------------------------------------------------------------
    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for segment in self.segments for p in segment.params]

    @property
    def numel(self) -> int:
        return sum(segment.numel for segment in self.segments)

    @property
    def gathered(self) -> bool:
        return all(segment.gathered for segment in self.segments)

    @property
    def live(self) -> bool:
        """Gathered or being gathered: its full buffers hold memory."""
        return any(segment.gathered or segment.in_flight for segment in self.segments)

    @property
    def can_swap_in(self) -> bool:
        """Whether gathering now needs no swap buffer that is not free (offload_param: nvme)."""
        return all(segment.can_swap_in for segment in self.segments if segment.swapped)

    def trainable_segment(self) -> FlatSegment:
        """The trainable segment (only a unit with trainable parameters has gradients to reduce)."""
        if self.trainable is None:
            raise RuntimeError(f"unit {self.name!r} holds no trainable parameter: it has no gradient to reduce")
        return self.trainable

    def gradient_shard(self) -> torch.Tensor:
        """``grad_shard``, which a unit with trainable parameters has once ``cast_`` ran."""
        if self.grad_shard is None:
            raise RuntimeError(f"unit {self.name!r} has no gradient shard (no trainable parameter, or not cast yet)")
        return self.grad_shard

    def cast_(self, dtype: torch.dtype) -> None:
        for segment in self.segments:
            segment.cast_(dtype)
        if self.trainable is not None:
            self.grad_shard = torch.zeros_like(self.trainable.local)

    def start_gather(self) -> None:
        for segment in self.segments:
            segment.start_gather()

    def finish_gather(self) -> None:
        for segment in self.segments:
            segment.finish_gather()

    def release(self) -> None:
        for segment in self.segments:
            segment.release()

    def mark_in_use(self, running: bool) -> None:
        """Record on the parameters (``ShardedParam.users``) that the unit's forward started or ended."""
        for segment in self.segments:
            for sharded in segment.sharded:
                (sharded.users.add if running else sharded.users.discard)(id(self.module))

    # ---- gradients -----------------------------------------------------------------------
    @torch.no_grad()
    def add_grad(self, param: torch.nn.Parameter) -> bool:
        """Move ``param.grad`` into the unit's flat gradient; True once every trainable parameter reported."""
        grad = param.grad
        assert grad is not None  # (called by the post-accumulate-grad hook: autograd has written it)
        if self._grad_full is None:
            trainable = self.trainable_segment()
            self._grad_full = self.buffers.take(trainable.layout.padded, trainable.local, zero=True)
        offset, numel = self._offset_of[id(param)]
        self._grad_full[offset:offset + numel].add_(grad.reshape(-1))
        param.grad = None
        self._grads_seen.add(id(param))
        return len(self._grads_seen) == len(self._offset_of)

    def launch_reduce(self, pre_factor: float, comm_dtype: torch.dtype | None = None) -> None:
        """Reduce-scatter this micro-step's gradient (zeros for parameters that got none); in ``comm_dtype``
        when given (``communication_data_type``)."""
        trainable = self.trainable_segment()
        full = self._grad_full
        if full is None:
            full = self.buffers.take(trainable.layout.padded, trainable.local, zero=True)
        with phase("reduce"), streams_for(full.device).on("reduce"):  # (behind the backward that wrote ``full``)
            if pre_factor != 1.0:
                full.div_(pre_factor)
            wire = comm.on_the_wire(full, comm_dtype)
            out = (self.buffers.take(trainable.layout.shard, trainable.local, zero=False) if wire is full
                   else torch.empty(trainable.layout.shard, dtype=wire.dtype, device=wire.device))
            handle = comm.reduce_scatter_tensor(out, wire, self.group, async_op=True)
        self._in_flight = (handle, out, full)
        self._grad_full = None
        self._grads_seen.clear()
        self.reduced = True

    def finish_reduce(self, post_factor: float) -> None:
        if self._in_flight is None:
            return
        handle, out, full = self._in_flight
        streams = streams_for(out.device)
        with phase("reduce"), streams.on("reduce"):
            handle.wait()
            self.gradient_shard().add_(out, alpha=post_factor)
        done = streams.mark("reduce")  # the computation reads grad_shard after joining the reduce stream
        self.buffers.give(full, after=done)
        if out.dtype == full.dtype:  # (a communication_data_type copy is not the pool's)
            self.buffers.give(out, after=done)
        self._in_flight = None

    def gradient_bytes_in_flight(self) -> int:
        held = [] if self._grad_full is None else [self._grad_full]
        if self._in_flight is not None:
            held += [self._in_flight[1], self._in_flight[2]]
        return sum(t.numel() * t.element_size() for t in held)
