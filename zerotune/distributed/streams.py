"""Side streams and events: on CUDA, collectives and host copies run beside the computation; on CPU, in order.

The engine's device work has three kinds besides the computation, each with a stream of its own on CUDA
(FSDP2 keeps the same split):

* ``gather``: stage 3's all-gathers -- the gathered buffer's allocation, an offloaded shard's copy to the
  device, the collective -- so a prefetched unit is gathered while the current one computes; the
  computation waits for a unit's gather only where it uses the unit (NCCL's ``Work.wait`` is such a
  stream wait, not a host wait);
* ``reduce``: gradient reductions (stage 3's reduce-scatters, stage 0-2's bucket all-reduces / reduces) and
  the arithmetic on their results, so the backward never waits for them; the computation waits for the
  reduce stream once, where it reads the reduced gradients (the end of backward, the optimizer step);
* ``copy``: device <-> host copies of offloaded state, into page-locked memory; the host waits for the
  copy stream's event (not for the whole device) before the host optimizer reads them.

A buffer one stream wrote and another still reads must not be reused or freed until that reader is done:
``DeferredRelease`` gives a buffer back only once an event recorded after its last use has completed
(``record_stream`` does the same for buffers the caching allocator frees).

On CPU (gloo) there are no streams: ``Streams`` is disabled, every context runs in place, every event is
``None`` and every release immediate -- the engine's work runs in program order, exactly as the parity
tests check it. ``phase`` names a profiler range (``zerotune.gather``, ``zerotune.reduce``, ``zerotune.step``,
``zerotune.offload_copy``) on every device, so a trace shows what overlaps what.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch

KINDS = ("gather", "reduce", "copy")
T = TypeVar("T")


def phase(name: str) -> contextlib.AbstractContextManager:
    """A profiler range ``zerotune.<name>`` (free when no profiler is recording)."""
    return torch.profiler.record_function(f"zerotune.{name}")


class Streams:
    """One device's side streams (``KINDS``); disabled (all in place) off CUDA."""

    def __init__(self, device: torch.device | None = None) -> None:
        device = device if device is not None else torch.device("cpu")
        self.enabled = device.type == "cuda" and torch.cuda.is_available()
        self._streams: dict[str, Any] = {kind: torch.cuda.Stream(device) for kind in KINDS} if self.enabled else {}

    def stream(self, kind: str) -> Any:
        return self._streams.get(kind)

    @contextlib.contextmanager
    def on(self, kind: str, after: Any = None) -> Iterator[None]:
        """Queue the block's device work on ``kind``'s stream, behind everything queued so far on the current
        stream (the work's inputs) and behind ``after`` (an event, or None). In place off CUDA."""
        if not self.enabled:
            yield
            return
        stream = self._streams[kind]
        stream.wait_stream(torch.cuda.current_stream())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield

    def mark(self, kind: str | None = None) -> Any:
        """An event after the work queued so far on ``kind``'s stream (None: the current stream); None off CUDA."""
        if not self.enabled:
            return None
        event = torch.cuda.Event()
        event.record(self._streams[kind] if kind is not None else torch.cuda.current_stream())
        return event

    def wait(self, event: Any) -> None:
        """The current stream waits for ``event`` (the host does not)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def join(self, kind: str) -> None:
        """The current stream waits for everything queued on ``kind``'s stream (before reading its results)."""
        if self.enabled:
            torch.cuda.current_stream().wait_stream(self._streams[kind])

    def keep_until_used(self, tensor: torch.Tensor) -> None:
        """``tensor``'s memory, about to be freed, was used by the current stream: the caching allocator hands
        it out again only after that use (``record_stream``); a tensor allocated on a side stream needs it."""
        if self.enabled and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream())


def host_wait(event: Any) -> None:
    """Block the host until ``event`` completed (a copy the host reads next); nothing to wait for off CUDA."""
    if event is not None:
        event.synchronize()


class DeferredRelease(Generic[T]):
    """Buffers given back (``give``) only after the event recorded after their last use completed.

    ``later(item, event)`` with ``event`` None gives it back at once (CPU: in program order, used is done).
    ``poll()`` gives back every item whose event completed, oldest first; ``drain()`` waits for all. Events
    need ``query()`` and ``synchronize()`` (``torch.cuda.Event``; tests use fakes)."""

    def __init__(self, give: Callable[[T], None]) -> None:
        self._give = give
        self._waiting: deque[tuple[T, Any]] = deque()

    def later(self, item: T, event: Any) -> None:
        if event is None:
            self._give(item)
        else:
            self._waiting.append((item, event))

    def poll(self) -> int:
        """Give back what is free now; returns how many items are still waiting."""
        while self._waiting and self._waiting[0][1].query():
            self._give(self._waiting.popleft()[0])
        return len(self._waiting)

    def drain(self) -> None:
        while self._waiting:
            item, event = self._waiting.popleft()
            event.synchronize()
            self._give(item)

    def waiting(self) -> list[T]:
        """The items not given back yet (still memory in use)."""
        return [item for item, _ in self._waiting]


_BY_DEVICE: dict[str, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """The process's side streams for ``device`` (one set per device, shared by every engine on it)."""
    key = str(device)
    if key not in _BY_DEVICE:
        _BY_DEVICE[key] = Streams(device)
    return _BY_DEVICE[key]
