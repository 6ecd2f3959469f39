"""Parameters laid end to end in one flat buffer that is sharded over the data-parallel ranks.

The layout is ``zero.partition.FlatLayout`` (the same math as stages 1 and 2): rank r holds the
contiguous slice ``[r * shard, (r + 1) * shard)`` of the padded flat buffer. Gathering is one
``all_gather_into_tensor`` straight into the full buffer, whose views *are* the parameters: no
copy in or out.

Memory: ``local`` (``layout.shard`` elements) is always held. ``full`` (``layout.padded``
elements) holds storage only while gathered: releasing resizes its storage to 0 bytes. The
storage object itself is kept, so every view of it -- the parameters' and the ones autograd
saved during forward (e.g. ``weight.t()``) -- sees the values again after the next gather.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.zero.partition import FlatLayout, flat_layout
from zerotune.zero.stage3.sharded_param import ParamState, ShardedParam, sharded_param_of


class FlatSegment:
    """A flat, sharded buffer of parameters that are gathered and released together."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 device: torch.device | None = None, local_device: torch.device | None = None,
                 pin_memory: bool = False) -> None:
        """Copy the parameters' current (full) values in; afterwards they are SHARDED.

        The segment keeps the parameters' dtype; ``cast_`` changes it (after fp32 masters were taken).
        ``local_device``: where the shard lives between uses (``offload_param: {device: cpu}``: the
        host, page-locked if ``pin_memory``); it is copied to the gather device for each gather.
        """
        self.params = list(params)
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        world = 1 if group is None else dist.get_world_size(group)
        self.layout: FlatLayout = flat_layout([p.numel() for p in self.params], world)
        first = self.params[0]
        device = device or first.device
        full = torch.zeros(self.layout.padded, dtype=first.dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(self.params, self.layout.offsets):
                full[offset:offset + param.numel()].copy_(param.detach().reshape(-1))
        start, end = self.layout.owned_range(self.rank)
        self._pin = pin_memory and torch.cuda.is_available()
        self.local = self._on_local_device(full[start:end].clone(), local_device)
        self._pending: comm.Handle | None = None
        self.on_local_changed: list[Callable[[], None]] = []
        """Called after ``local`` was overwritten outside training (e.g. to refresh fp32 masters)."""
        self._bind(full)

    def _bind(self, full: torch.Tensor) -> None:
        """Make ``full`` the gather target, point the parameters' states at its views, then release it."""
        for param in self.params:
            previous = sharded_param_of(param)
            if previous is not None:
                previous.detach()
        self.full = full
        self.sharded = [ShardedParam(p, self, i, full[o:o + p.numel()].view(p.shape))
                        for i, (p, o) in enumerate(zip(self.params, self.layout.offsets))]
        self._full_bytes = full.untyped_storage().nbytes()
        self.gathered = True
        self.release()

    def _on_local_device(self, shard: torch.Tensor, local_device: torch.device | None) -> torch.Tensor:
        if local_device is None or shard.device == local_device:
            return shard
        return torch.empty(shard.shape, dtype=shard.dtype, device=local_device, pin_memory=self._pin).copy_(shard)

    @torch.no_grad()
    def cast_(self, dtype: torch.dtype) -> None:
        """Change the segment's (and so the parameters') dtype; call while released, before training."""
        if dtype == self.local.dtype:
            return
        self.local = self._on_local_device(self.local.to(dtype), self.local.device)
        self._bind(torch.empty(self.layout.padded, dtype=dtype, device=self.full.device))

    @property
    def state(self) -> ParamState:
        return ParamState.UNSHARDED if self.gathered else ParamState.SHARDED

    @property
    def numel(self) -> int:
        return self.layout.padded

    def start_gather(self) -> None:
        """Launch the all-gather of every rank's shard into ``full`` (no-op if gathered or in flight)."""
        if self.gathered or self._pending is not None:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        source = self.local if self.local.device == self.full.device else self.local.to(self.full.device,
                                                                                            non_blocking=self._pin)
        self._pending = comm.all_gather_into_tensor(self.full, source, self.group, async_op=True)

    def finish_gather(self) -> None:
        """Wait for the gather (starting it if needed) and show the full values in the parameters."""
        if self.gathered:
            return
        self.start_gather()
        self._pending.wait()
        self._pending = None
        for sharded in self.sharded:
            sharded.to_unsharded()
        self.gathered = True

    def release(self) -> None:
        """Back to SHARDED: parameters show placeholders and the full buffer's storage is freed."""
        if self._pending is not None:  # never free a buffer a collective is writing into
            self._pending.wait()
            self._pending = None
        elif not self.gathered:
            return
        for sharded in self.sharded:
            sharded.to_sharded()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def notify_local_changed(self) -> None:
        for callback in self.on_local_changed:
            callback()

    def discard(self) -> None:
        """Free this segment's memory after its parameters were re-partitioned into another segment."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        self.full.untyped_storage().resize_(0)
        self.local = self.local[:0]
        self.gathered = False

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def gathered_bytes(self) -> int:
        return self._full_bytes if (self.gathered or self._pending is not None) else 0

    def local_bytes(self) -> int:
        return self.local.numel() * self.local.element_size()
