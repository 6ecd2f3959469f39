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

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.distributed.streams import host_wait, phase, streams_for
from zerotune.offload.pinned import track_pinned
from zerotune.zero.partition import FlatLayout, flat_layout
from zerotune.zero.stage3.sharded_param import ParamState, ShardedParam, sharded_param_of


class FlatSegment:
    """A flat, sharded buffer of parameters that are gathered and released together."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group: dist.ProcessGroup | None,
                 device: torch.device | None = None, local_device: torch.device | None = None,
                 pin_memory: bool = False, persistent: bool = False) -> None:
        """Copy the parameters' current (full) values in; afterwards they are SHARDED.

        The segment keeps the parameters' dtype; ``cast_`` changes it (after fp32 masters were taken).
        ``local_device``: where the shard lives between uses (``offload_param: {device: cpu}``: the
        host, page-locked if ``pin_memory``); it is copied to the gather device for each gather.
        ``persistent``: the owner keeps it gathered between uses (recorded on the parameters as ``ds_persist``).
        """
        self.params = list(params)
        self.persistent = persistent
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
        self._copied_out: Any = None  # CUDA event after the last asynchronous copy of a host shard to the device
        self._swap: tuple[Any, str, Any] | None = None  # (SwapStore, file name, buffer pool) under offload_param nvme
        self._local_resident = True
        self._local_bytes = self.local.untyped_storage().nbytes()
        self._buffer: torch.Tensor | None = None  # the swap-pool buffer holding the shard, if any
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
        return track_pinned(torch.empty(shard.shape, dtype=shard.dtype, device=local_device,
                                        pin_memory=self._pin)).copy_(shard)

    @torch.no_grad()
    def cast_(self, dtype: torch.dtype) -> None:
        """Change the segment's (and so the parameters') dtype; call while released, before training."""
        if dtype == self.local.dtype:
            return
        self.local = self._on_local_device(self.local.to(dtype), self.local.device)
        self._bind(torch.empty(self.layout.padded, dtype=dtype, device=self.full.device))

    @property
    def state(self) -> ParamState:
        if self.gathered:
            return ParamState.UNSHARDED
        return ParamState.GATHERING if self._pending is not None else ParamState.SHARDED

    @property
    def numel(self) -> int:
        return self.layout.padded

    # ---- the shard in a swap file (offload_param: {device: nvme}) ----------------------------
    def swap_out_to(self, store: Any, name: str, pool: Any = None) -> None:
        """Keep the shard in ``store``'s file ``name`` from now on, in memory only while needed: in one of
        ``pool``'s buffers (``offload_param.buffer_count`` x ``buffer_size``), or without a pool (zero.Init,
        read back once by initialize) in its own storage."""
        if pool is not None and self.local.numel() > pool.buffer_size:
            raise ValueError(f"zero_optimization.offload_param.buffer_size is {pool.buffer_size} elements, smaller "
                             f"than a unit's parameter shard ({self.local.numel()} elements); raise it to at least "
                             "that")
        store.allocate(name, self.local.numel(), self.local.dtype)
        store.write(name, self.local).wait()
        self._swap = (store, name, pool)
        self._drop_local()

    @property
    def swapped(self) -> bool:
        """Whether the shard lives in a swap file (offload_param: nvme)."""
        return self._swap is not None

    @property
    def resident(self) -> bool:
        """Whether the shard is in memory (always, unless it lives in a swap file)."""
        return self._local_resident

    @property
    def can_swap_in(self) -> bool:
        """Whether the shard is in memory or a swap buffer is free for it (prefetch asks before gathering)."""
        if self._local_resident:
            return True
        pool = self._swapped_to()[2]
        return pool is None or pool.free_count > 0

    def _swapped_to(self) -> tuple[Any, str, Any]:
        """(SwapStore, file name, buffer pool) of a shard in a swap file: a shard that is not resident is one."""
        if self._swap is None:
            raise RuntimeError("the parameter shard is not in a swap file (offload_param: nvme), so it is resident")
        return self._swap

    def make_resident(self) -> torch.Tensor:
        """The shard in memory (read from its swap file if swapped out); it stays until ``store_local``."""
        if not self._local_resident:
            store, name, pool = self._swapped_to()
            if pool is None:
                self.local.untyped_storage().resize_(self._local_bytes)
            else:
                try:
                    self._buffer = pool.acquire(self.layout.shard, self.local.dtype)
                except RuntimeError as error:
                    raise RuntimeError(f"{error} (zero_optimization.offload_param.buffer_count: the shards in use at "
                                       "once, gathered and prefetched units included)") from error
                self.local.set_(self._buffer)  # type: ignore[arg-type]  # (torch's stubs lack set_(Tensor))
            store.read(name, self.local).wait()
            self._local_resident = True
            self._point_pieces()
        return self.local

    def store_local(self) -> None:
        """Write a resident shard back to its swap file and free its memory (no-op without swapping)."""
        if self._swap is not None and self._local_resident:
            store, name, _ = self._swap
            store.write(name, self.local).wait()
            self._drop_local()

    def _fence_local(self) -> None:
        """Before the host writes or frees a pinned host shard: wait for the asynchronous copy to the device a
        gather may still be reading it with (no-op when none is in flight, and off CUDA)."""
        host_wait(self._copied_out)
        self._copied_out = None

    def _drop_local(self) -> None:
        if self._swap is None or not self._local_resident:
            return
        self._fence_local()
        pool = self._swap[2]
        if pool is None:
            self.local.untyped_storage().resize_(0)
        else:  # the tensor object stays (empty until the next read), and the buffer goes back
            self.local.set_(self.local.new_empty(0))  # type: ignore[call-overload]  # (stubs lack set_(Tensor))
            if self._buffer is not None:
                pool.release(self._buffer)
                self._buffer = None
        self._local_resident = False
        self._point_pieces()

    def _point_pieces(self) -> None:
        """The shard's storage changed (swapped in or out): re-point the parameters' pieces (``ds_tensor``)."""
        for sharded in self.sharded:
            sharded.point_piece()

    def overwrite_local(self, values: torch.Tensor, notify: bool = True) -> None:
        """Replace this rank's shard (checkpoint load, masters rounded in, a modified parameter)."""
        self._fence_local()
        with torch.no_grad():  # from pinned host masters: asynchronous, ordered before the next gather
            self.make_resident().copy_(values, non_blocking=values.is_pinned())
        self.store_local() if not notify else self.notify_local_changed()

    def write_local_range(self, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` at ``[lo, lo + n)`` of the shard, in memory or straight into its swap file."""
        if self._swap is not None and not self._local_resident:
            store, name, _ = self._swap
            store.write(name, values.to(self.local.dtype).contiguous(), offset_numel=lo).wait()
        else:
            self._fence_local()
            with torch.no_grad():
                self.local[lo:lo + values.numel()].copy_(values)

    def read_local(self) -> torch.Tensor:
        """A copy of this rank's shard (e.g. for a checkpoint)."""
        was_resident = self._local_resident
        copy = self.make_resident().clone()
        if not was_resident:
            self._drop_local()
        return copy

    # ---- gather / release ------------------------------------------------------------------
    def start_gather(self) -> None:
        """Launch the all-gather of every rank's shard into ``full`` (no-op if gathered or in flight)."""
        if self.gathered or self._pending is not None:
            return
        self.make_resident()
        # On CUDA the buffer is allocated, an offloaded shard copied in and the collective queued on the gather
        # stream, behind the computation queued so far (which wrote the shard): a prefetch runs beside it.
        with phase("gather"), streams_for(self.full.device).on("gather"):
            self.full.untyped_storage().resize_(self._full_bytes)
            source = self.local if self.local.device == self.full.device else self.local.to(self.full.device,
                                                                                                non_blocking=self._pin)
            if source is not self.local and self._pin:  # the host must not rewrite the shard while it is read
                self._copied_out = streams_for(self.full.device).mark("gather")
            self._pending = comm.all_gather_into_tensor(self.full, source, self.group, async_op=True)
        for sharded in self.sharded:
            sharded.to_gathering()

    def finish_gather(self) -> None:
        """Wait for the gather (starting it if needed) and show the full values in the parameters."""
        if self.gathered:
            return
        self.start_gather()
        pending = self._pending
        assert pending is not None  # (start_gather launched it: the segment is not gathered)
        with phase("gather"):
            pending.wait()  # NCCL: the computation's stream waits for this gather, not the host
        self._pending = None
        self._drop_local()  # the swap file still holds it: the gather did not change it
        for sharded in self.sharded:
            sharded.to_unsharded()
        self.gathered = True

    def release(self) -> None:
        """Back to SHARDED: parameters show placeholders and the full buffer's storage is freed."""
        if self._pending is not None:  # never free a buffer a collective is writing into
            self._pending.wait()
            self._pending = None
            self._drop_local()
        elif not self.gathered:
            return
        for sharded in self.sharded:
            sharded.to_sharded()
        streams_for(self.full.device).keep_until_used(self.full)  # allocated on the gather stream, read here
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def notify_local_changed(self) -> None:
        """``local`` was overwritten: tell the masters, then (swapping) write it back to its file."""
        for callback in self.on_local_changed:
            callback()
        self.store_local()

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
        """Bytes of the shard held in memory now (0 while it is in its swap file)."""
        return self.local.numel() * self.local.element_size() if self._local_resident else 0
