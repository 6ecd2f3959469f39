"""ZeRO stage 2 gradient sync: reduce each bucket to its owner during backward.

Full-size gradients never persist. As autograd produces a parameter's gradient, a hook copies
it into the bucket(s) covering it and drops ``param.grad``. Buckets are cut at the boundaries
between ranks' slices (``partition.FlatLayout``), so every bucket has exactly one owner; a
complete bucket is reduced to its owner -- asynchronously while backward goes on with
``overlap_comm`` (at most ``max_in_flight`` buckets in flight), or at once otherwise -- and the
owner adds it into its contiguous gradient slice (``contiguous_gradients``). Bucket buffers are
recycled, so gradient memory is one slice plus a few buckets.

Every micro-step communicates (accumulating full gradients locally would cost stage 1's
memory); the owner's slice accumulates across micro-steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm, compression
from zerotune.distributed.buckets import Bucket, BucketPiece, GradientBuckets
from zerotune.distributed.streams import DeferredRelease, phase, streams_for
from zerotune.zero.contracts import TiedWeight
from zerotune.zero.flat_params import FlatParamGroup
from zerotune.zero.grad_hooks import register_grad_ready_hooks
from zerotune.zero.partition import split_at_owner_boundaries


@dataclass(frozen=True)
class ReduceTarget:
    """Where a bucket's reduced sum goes: ``owner``'s slice of group ``group``, flat range [lo, hi)."""

    group: int
    owner: int
    lo: int
    hi: int


def plan_buckets(flat_groups: Sequence[FlatParamGroup], bucket_numel: int,
                 position: dict[int, int]) -> tuple[list[list[BucketPiece]], list[ReduceTarget]]:
    """Cut each group's flat range, from its end, at owner boundaries and every ``bucket_numel``.

    Buckets are ordered by when their gradients should be ready: the last parameters of the
    model (highest ``position``) first, as backward produces them.
    """
    planned = []
    for g, fg in enumerate(flat_groups):
        for owner, span_lo, span_hi in split_at_owner_boundaries(fg.layout, 0, fg.layout.total):
            hi = span_hi
            while hi > span_lo:
                lo = max(span_lo, hi - bucket_numel)
                pieces = [BucketPiece(fg.params[p.param], p.param_offset, p.length, p.flat_offset - lo)
                          for p in fg.layout.pieces_in(lo, hi)]
                planned.append((pieces, ReduceTarget(g, owner, lo, hi)))
                hi = lo
    planned.sort(key=lambda item: -max(position[id(piece.param)] for piece in item[0]))
    return [pieces for pieces, _ in planned], [target for _, target in planned]


class UnusedParameterError(AssertionError):
    """A trainable parameter took no part in the loss while ``ignore_unused_parameters`` is false. An
    ``AssertionError``, as DeepSpeed's check is an assert (code written against it catches that)."""


class BucketedReduceGradSync:
    """Only the owner keeps a gradient slice; buckets are reduced to it as backward runs."""

    reduces_every_backward = True

    def __init__(self, flat_groups: Sequence[FlatParamGroup], group: dist.ProcessGroup | None, *,
                 bucket_numel: int, position: dict[int, int], predivide_factor: float = 1.0,
                 max_in_flight: int = 2, compressor: compression.TopKCompressor | None = None,
                 on_final_grad: Callable[[int, int, torch.Tensor], None] | None = None,
                 comm_dtype: torch.dtype | None = None, require_all_grads: dict[int, str] | None = None) -> None:
        self.flat_groups = list(flat_groups)
        self.require_all_grads = require_all_grads
        """``ignore_unused_parameters: false``: id(param) -> name; a round where one got no gradient is an error."""
        self._ready: set[int] = set()
        self.comm_dtype = comm_dtype  # communication_data_type: the buckets are reduced in it
        self.group = group
        world = 1 if group is None else dist.get_world_size(group)
        self.pre_factor = float(predivide_factor)
        self.post_factor = self.pre_factor / world
        self.max_in_flight = max_in_flight
        self.grad_shards = [torch.zeros(fg.layout.shard, dtype=fg.buffer.dtype, device=fg.buffer.device)
                            for fg in self.flat_groups]
        dtype = self.grad_shards[0].dtype if self.grad_shards else torch.float32
        device = self.grad_shards[0].device if self.grad_shards else torch.device("cpu")
        bucket_pieces, targets = plan_buckets(self.flat_groups, bucket_numel, position)
        self.buckets = GradientBuckets.from_pieces(bucket_pieces, dtype, device, self._launch, targets)
        self._dtype, self._device = dtype, device
        self._largest_bucket = max((b.numel for b in self.buckets.buckets), default=0)
        self._free_buffers: list[torch.Tensor] = []  # recycled bucket storages
        self._returning: DeferredRelease[torch.Tensor] = DeferredRelease(self._free_buffers.append)
        self._streams = streams_for(device)
        self._storage_of: dict[int, torch.Tensor] = {}
        self._in_flight: deque[tuple[Bucket, comm.Handle, torch.Tensor]] = deque()  # (bucket, handle, on the wire)
        self._round_open = False
        self._boundary = False
        self.on_final_grad = on_final_grad
        """``(group, lo, grad)``: a part of a gradient slice is final (last micro-step), e.g. to copy it to the host."""
        params = [p for fg in self.flat_groups for p in fg.params]
        self._hooks = register_grad_ready_hooks(params, self._on_grad_ready)
        self.compressor = compressor  # Top-K gradient compression of the reduces (gradient_compression)

    def begin_micro_step(self, is_boundary: bool) -> None:
        """Every micro-step is a communication round; close the previous one first."""
        if self._round_open:
            self._complete_round()
        self._boundary = is_boundary
        self.buckets.start_round()
        self._ready.clear()
        self._round_open = True

    def _buffer_for(self, bucket: Bucket) -> torch.Tensor:
        """A zeroed buffer for ``bucket``, recycled from retired buckets (no allocation, no page faults)."""
        if bucket.buffer is None:
            self._returning.poll()  # (a storage the reduce stream still reads is not reused before it is done)
            storage = self._free_buffers.pop() if self._free_buffers else torch.empty(
                self._largest_bucket, dtype=self._dtype, device=self._device)
            bucket.buffer = storage[:bucket.numel].zero_()
            self._storage_of[id(bucket)] = storage
        return bucket.buffer

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        assert grad is not None  # a post-accumulate-grad hook runs once autograd has written the gradient
        for bucket, piece in self.buckets.pieces_of[id(param)]:
            self._buffer_for(bucket)
            bucket.view(piece).copy_(piece.of(grad))
        param.grad = None
        if self._round_open:
            if self.require_all_grads is not None:  # (only ignore_unused_parameters: false looks)
                self._ready.add(id(param))
            self.buckets.mark_ready(param)

    def _launch(self, bucket: Bucket) -> None:
        buffer = self._buffer_for(bucket)  # a bucket nobody wrote (unused parameters) reduces zeros
        with phase("reduce"), self._streams.on("reduce"):  # behind the backward that filled it
            if self.pre_factor != 1.0:
                buffer.div_(self.pre_factor)
            wire = buffer
            if self.compressor is not None:
                handle = compression.reduce(buffer, bucket.target.owner, self.group, self.compressor,
                                            f"reduce.{bucket.index}", async_op=True)
            else:
                wire = comm.on_the_wire(buffer, self.comm_dtype)
                handle = comm.reduce(wire, bucket.target.owner, self.group, async_op=True)
        self._in_flight.append((bucket, handle, wire))
        while len(self._in_flight) > self.max_in_flight:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        bucket, handle, wire = self._in_flight.popleft()
        target = bucket.target
        fg = self.flat_groups[target.group]
        part = None
        with phase("reduce"), self._streams.on("reduce"):
            handle.wait()
            if target.owner == fg.rank:
                start = fg.layout.owned_range(fg.rank)[0]
                part = self.grad_shards[target.group][target.lo - start:target.hi - start]
                part.add_(wire, alpha=self.post_factor)
        if part is not None and self._boundary and self.on_final_grad is not None:
            self.on_final_grad(target.group, target.lo - fg.layout.owned_range(fg.rank)[0], part)
        bucket.buffer = None
        self._returning.later(self._storage_of.pop(id(bucket)), self._streams.mark("reduce"))

    def _complete_round(self) -> None:
        if self.require_all_grads is not None:
            self._check_every_param_had_a_grad()
        self.buckets.launch_remaining()
        while self._in_flight:
            self._retire_oldest()
        self._streams.join("reduce")  # the step reads the gradient shards next
        self._returning.poll()  # (storages the reduce stream still reads come back at a later poll)
        del self._free_buffers[max(1, self.max_in_flight):]  # keep a few for reuse, not a whole model's worth
        self._round_open = False

    def _check_every_param_had_a_grad(self) -> None:
        assert self.require_all_grads is not None
        unused = [name for key, name in self.require_all_grads.items() if key not in self._ready]
        if unused:
            self._round_open = False  # the round is abandoned with the error: nothing of it is reduced
            raise UnusedParameterError(
                f"zero_optimization.ignore_unused_parameters is false and {len(unused)} trainable parameter(s) got "
                f"no gradient in this backward: {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}. Set "
                "ignore_unused_parameters true (the default: they take a zero gradient), or make every trainable "
                "parameter take part in the loss")

    def finish(self, ties: Sequence[TiedWeight] = ()) -> None:
        """Complete the boundary micro-step's reductions; ``shard_grad(g)`` then holds the mean gradient, and each
        tied weight's slices the sum over the pipeline stages holding it (``sum_full_grad_over``)."""
        if self._round_open:
            self._complete_round()
        for param, group in ties:
            self.sum_full_grad_over(param, group)

    def settle(self) -> None:
        """Finish the reductions still in flight (the step's ``finish`` then has none left): every micro-step's
        gradients are reduced to their owners, so the slices are the means accumulated so far."""
        self.finish()

    def whole_grad(self, param: torch.nn.Parameter) -> None:
        """No rank ever holds a whole gradient: only its slices (``shard_grad``)."""
        return None

    def shard_grad(self, group_index: int) -> torch.Tensor:
        return self.grad_shards[group_index]

    def sum_full_grad_over(self, param: torch.nn.Parameter, group: dist.ProcessGroup | None) -> None:
        """Sum ``param``'s (mean) gradient over ``group`` -- the pipeline stages sharing a tied weight --
        after ``finish()``. Each data-parallel rank holds a slice of it, so the slices are assembled into
        the whole gradient (an all-reduce over the data-parallel group, where each element has one
        owner), summed over ``group``, and every rank keeps its slice of the sum."""
        g, index = next((g, i) for g, fg in enumerate(self.flat_groups) for i, p in enumerate(fg.params) if p is param)
        layout = self.flat_groups[g].layout
        offset, numel = layout.offsets[index], param.numel()
        start, end = layout.owned_range(self.flat_groups[g].rank)
        lo, hi = max(start, offset), min(end, offset + numel)
        full = torch.zeros(numel, dtype=self._dtype, device=self._device)
        if lo < hi:
            full[lo - offset:hi - offset] = self.grad_shards[g][lo - start:hi - start]
        comm.all_reduce(full, self.group)
        comm.all_reduce(full, group)
        if lo < hi:
            self.grad_shards[g][lo - start:hi - start] = full[lo - offset:hi - offset]

    def release_scratch(self) -> int:
        """Free the recycled bucket storages kept between rounds (allocated again when a backward needs them);
        returns their bytes. Call between rounds (``engine.offload_states``' contiguous_grad_buffer)."""
        self._returning.poll()
        freed = sum(t.numel() * t.element_size() for t in self._free_buffers)
        self._free_buffers.clear()
        return freed

    def zero_grad(self) -> None:
        for shard in self.grad_shards:
            shard.zero_()
        for fg in self.flat_groups:
            for param in fg.params:
                param.grad = None

    def grad_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.grad_shards)

    def buffer_bytes(self) -> int:
        """Bucket buffers held (recycled between buckets; one filling plus up to ``max_in_flight`` in flight)."""
        held = list(self._free_buffers) + list(self._storage_of.values())
        return sum(t.numel() * t.element_size() for t in held)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
