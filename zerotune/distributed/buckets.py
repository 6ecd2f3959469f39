"""THE bucketing helper: pack parameters' gradients into a few flat buffers.

Communicating one large flat buffer is much cheaper than one collective per parameter, and
launching a bucket as soon as all its gradients exist overlaps communication with the rest
of backward. Gradients become ready roughly in reverse registration order, so buckets are
filled from the last parameter backwards (as DDP does).

Buckets are launched strictly in index order on every rank: even when gradients arrive in a
slightly different order on different ranks, the collectives still match up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def assign_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Group parameter indices (in reverse order) into buckets of at most ``bucket_numel`` elements.

    A parameter larger than the cap gets a bucket of its own. Pure function: easy to test.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least 1 element, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(numels))):
        if current and filled + numels[index] > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numels[index]
    if current:
        buckets.append(current)
    return buckets


@dataclass
class Bucket:
    """One flat buffer and the parameters whose gradients live in it (as shaped views)."""

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0  # gradients still expected in the current accumulation boundary step
    launched: bool = False

    @property
    def numel(self) -> int:
        return self.buffer.numel()


@dataclass
class GradientBuckets:
    """Flat gradient buffers for ``params`` plus the launch-in-order bookkeeping.

    ``launch`` is the strategy's collective (all-reduce for data parallel, reduce-scatter for
    ZeRO-2); it is called with each bucket, in order, once that bucket and all before it are
    complete.
    """

    buckets: list[Bucket]
    launch: Callable[[Bucket], None]
    bucket_of: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(param) -> (bucket, slot)
    next_to_launch: int = 0

    @classmethod
    def build(cls, params: Sequence[torch.nn.Parameter], bucket_numel: int, dtype: torch.dtype,
              device: torch.device, launch: Callable[[Bucket], None]) -> GradientBuckets:
        buckets = []
        bucket_of: dict[int, tuple[int, int]] = {}
        for b, indices in enumerate(assign_buckets([p.numel() for p in params], bucket_numel)):
            members = [params[i] for i in indices]
            buffer = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=device)
            views, offset = [], 0
            for slot, p in enumerate(members):
                views.append(buffer[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
                bucket_of[id(p)] = (b, slot)
            buckets.append(Bucket(b, members, buffer, views))
        return cls(buckets, launch, bucket_of)

    def view_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        b, slot = self.bucket_of[id(param)]
        return self.buckets[b].views[slot]

    def start_round(self) -> None:
        """Arm every bucket for a communicating micro-step."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
        self.next_to_launch = 0

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Called when ``param``'s gradient for this round is in its bucket view."""
        bucket = self.buckets[self.bucket_of[id(param)][0]]
        bucket.pending -= 1
        self._launch_ready_prefix()

    def launch_remaining(self) -> None:
        """Launch every bucket not yet launched (parameters that got no gradient this step)."""
        while self.next_to_launch < len(self.buckets):
            self._launch(self.buckets[self.next_to_launch])

    def _launch_ready_prefix(self) -> None:
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending <= 0:
            self._launch(self.buckets[self.next_to_launch])

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self.next_to_launch += 1
        self.launch(bucket)

    def zero_(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
