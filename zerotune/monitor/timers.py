"""Named wall-clock timers for DeepSpeed's ``wall_clock_breakdown``.

CUDA kernels run asynchronously, so reading the host clock right after launching a
forward pass measures only the launch. When a ``synchronize`` callable is given
(``torch.cuda.synchronize``) it is called before each clock read so the span covers
the real device work. That sync stalls the pipeline, which is why the timers are off
unless asked for, and why a disabled timer must cost next to nothing.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Sequence

# One shared no-op context: a disabled ``with timers("x")`` allocates nothing.
_NO_OP = contextlib.nullcontext()


class _Span:
    """Context manager that starts a named timer on enter and stops it on exit."""

    __slots__ = ("_timers", "_name")

    def __init__(self, timers: WallClockTimers, name: str) -> None:
        self._timers = timers
        self._name = name

    def __enter__(self) -> None:
        self._timers.start(self._name)

    def __exit__(self, *exc_info: object) -> None:
        self._timers.stop(self._name)


class WallClockTimers:
    """Named wall-clock timers (forward, backward, reduce, step) accumulated over a reporting window.

    Each timer keeps a total and a call count since the last ``window_means_ms(reset=True)``,
    so the report shows the mean time per call, independent of how many micro-batches
    a window contained.
    """

    def __init__(self, enabled: bool, synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self._started_at: dict[str, float] = {}
        self._total_s: dict[str, float] = {}
        self._calls: dict[str, int] = {}

    def __call__(self, name: str) -> ContextManager[None]:
        """``with timers("forward"): ...`` times the block; a shared no-op when disabled."""
        if not self.enabled:
            return _NO_OP
        return _Span(self, name)

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter()

    def start(self, name: str) -> None:
        """Start timer ``name``; for spans that begin in one method and end in another."""
        if not self.enabled:
            return
        if name in self._started_at:
            raise RuntimeError(f"timer {name!r} was started twice without stop({name!r}) in between")
        self._started_at[name] = self._now()

    def stop(self, name: str) -> None:
        """Stop timer ``name`` and add the elapsed time to its window total."""
        if not self.enabled:
            return
        started_at = self._started_at.pop(name, None)
        if started_at is None:
            running = sorted(self._started_at) or "none"
            raise RuntimeError(f"timer {name!r} was stopped but never started; running timers: {running}")
        self._total_s[name] = self._total_s.get(name, 0.0) + (self._now() - started_at)
        self._calls[name] = self._calls.get(name, 0) + 1

    def window_means_ms(self, reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per call of each timer that completed a span in this window.

        Timers still running are left running (their span ends up in the next window).
        """
        means = {name: 1000.0 * total / self._calls[name] for name, total in self._total_s.items()}
        if reset:
            self._total_s.clear()
            self._calls.clear()
        return means

    @staticmethod
    def format(means: dict[str, float]) -> str:
        """Render means as ``"forward: 12.3ms | backward: 20.1ms"`` (in the timers' first-use order)."""
        return " | ".join(f"{name}: {ms:.1f}ms" for name, ms in means.items())


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """Mean of ``data`` without its ``trim_percent`` smallest and largest values (rounded count), so one slow
    outlier (a first collective paying for connection setup) does not dominate a latency report. ``data`` is
    not reordered: the comms log keeps latencies and bandwidths as parallel lists, index i the i-th call."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent must be within [0, 1], got {trim_percent}")
    n = len(data)
    if n == 0:
        return 0
    k = int(round(n * trim_percent))
    kept = sorted(data)[k:n - k]
    if not kept:
        raise ValueError(f"trim_mean: trimming {trim_percent:.0%} from each end of {n} values leaves none")
    return sum(kept) / len(kept)
