"""Peak bytes of tensor storage allocated during a block, from torch's own allocator reports.

Why the profiler: the CPU build has no ``memory_allocated()`` counter, and the tests that check
ZeRO memory claims must not trust zerotune's own accounting. With ``profile_memory=True`` every
allocator call (CPU allocator and CUDA caching allocator alike, including
``UntypedStorage.resize_`` and the outputs of gloo/NCCL collectives) is recorded as an
``Allocation`` event carrying its pointer and signed size. Replaying them in time order gives
the live bytes at every instant.

What counts: storage allocated inside the block, while it is still alive. Frees of storage that
existed before the block are ignored (the CPU allocator does not even report most of them), so
``peak`` is "the most bytes the block itself had allocated at once" -- the right measure for
"gathering one unit at a time never holds more than X". A free is matched to its allocation by
pointer, which also discards stale frees the allocator reports for blocks it saw in an earlier
profiling session.

Usage::

    with PeakTensorBytes() as probe:
        step()
    assert probe.peak <= budget, probe.summary()

Cannot be nested, and cannot run while another torch profiler is active.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


class PeakTensorBytes:
    """Context manager: ``peak``, ``allocated``, ``freed`` (bytes) of storage allocated during the block.

    ``peak``: the most bytes allocated in the block that were alive at the same time (all
    devices together); ``peak_by_device``: the same per device (``"cpu"``, ``"cuda:0"``...);
    ``allocated``: total bytes allocated (counting every allocation, so a loop reallocating one
    buffer counts it each time); ``freed``: bytes of those allocations freed before the block
    ended; ``live_at_exit = allocated - freed``.
    """

    def __init__(self, exclude_mapped_files: bool = False) -> None:
        """``exclude_mapped_files``: leave out storages memory-mapped from files (``torch.load(mmap=True)``):
        the OS pages them in on use and can drop them again, so they are not allocated memory (``mapped``
        counts them instead). Needs Python stacks in the trace, which costs time."""
        self.peak = self.allocated = self.freed = self.mapped = 0
        self.peak_by_device: dict[str, int] = {}
        self._profiler: profile | None = None
        self._exclude_mapped = exclude_mapped_files

    def __enter__(self) -> PeakTensorBytes:
        # CPU activity only: the allocator hooks report CUDA allocations too, without CUPTI's cost.
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                 with_stack=self._exclude_mapped)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(*exc_info)
        # The raw event tree: prof.events() would attribute allocations made inside an op to that
        # op and show only the others as "[memory]" rows, losing the per-allocation sizes.
        tree = profiler.profiler.kineto_results.experimental_event_tree()
        events = list(_allocation_events(tree, self._exclude_mapped))
        self.mapped = sum(event.extra_fields.alloc_size for event, mapped in events if mapped)
        self._replay(sorted((event for event, mapped in events if not mapped), key=lambda event: event.start_time_ns))

    @property
    def live_at_exit(self) -> int:
        return self.allocated - self.freed

    def summary(self) -> str:
        by_device = ", ".join(f"{device}: {_mib(n)}" for device, n in sorted(self.peak_by_device.items()))
        return (f"peak {_mib(self.peak)} ({by_device or 'nothing allocated'}), allocated {_mib(self.allocated)}, "
                f"freed {_mib(self.freed)}, live at exit {_mib(self.live_at_exit)}")

    def _replay(self, events: Iterable) -> None:
        live: dict[tuple[str, int], int] = {}  # (device, pointer) -> bytes allocated in the block
        live_total, live_by_device = 0, {}
        for event in events:
            fields = event.extra_fields
            size, where = fields.alloc_size, (str(fields.device), fields.ptr)
            if size > 0:
                if where in live:  # a free we never saw (reported outside the block): stop counting it
                    live_total -= live[where]
                    live_by_device[where[0]] -= live[where]
                live[where] = size
                self.allocated += size
                live_total += size
                live_by_device[where[0]] = live_by_device.get(where[0], 0) + size
                self.peak = max(self.peak, live_total)
                self.peak_by_device[where[0]] = max(self.peak_by_device.get(where[0], 0), live_by_device[where[0]])
            elif size < 0 and where in live:
                released = live.pop(where)
                self.freed += released
                live_total -= released
                live_by_device[where[0]] -= released


@contextmanager
def saved_for_backward(params: Iterable[torch.Tensor]) -> Iterator[dict[int, int]]:
    """Distinct non-parameter tensor storages autograd saves for backward inside the block, as
    {storage pointer: bytes} (filled as the forward runs; views of one buffer count once). Storages stay
    alive until backward, so a pointer is never reused within one forward."""
    excluded = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


def _allocation_events(roots: Iterable, find_mapped: bool = False) -> Iterator[tuple]:
    """``(allocation event, made by a file mapping)`` in pre-order (each thread's in the order they happened)."""
    stack = [(event, False) for event in reversed(list(roots))]
    while stack:
        event, mapped = stack.pop()
        mapped = mapped or (find_mapped and "from_file" in _name(event))
        if event.tag == _EventType.Allocation:
            yield event, mapped
        stack.extend((child, mapped) for child in reversed(event.children))


def _name(event: object) -> str:
    try:
        return event.name
    except UnicodeDecodeError:  # some Python-frame events carry undecodable bytes
        return ""


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"
