"""The collective watchdog: a collective still pending after ``comm_timeout_s`` ends the process, loudly.

A rank that stops (SIGSTOP, a debugger, a hung data loader, a deadlock in user code) leaves the others
waiting inside a collective until torch's own timeout -- 30 minutes by default -- and then fails with a
message from deep inside gloo / NCCL. Every collective passes through ``comm.run_collective``, which
registers it here while it is pending (a blocking call until it returns, an asynchronous one until its
work completes). A daemon thread looks once a second: past the timeout it prints which collective is
pending (op, group size, bytes, the zerotune call site, how long) and every thread's Python stack, then
ends the process with exit status ``EXIT_STATUS``, so a launcher (torchrun) tears the job down.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

EXIT_STATUS = 75
"""Exit status of a process the watchdog ended (EX_TEMPFAIL: a restart may succeed)."""


@dataclass
class _Pending:
    op: str
    ranks: int
    nbytes: int
    site: str
    started: float
    handle: Any = None
    """A weak reference to the ``comm.Handle`` of an asynchronous collective (the watchdog must not keep its
    buffers alive: that would hold every gathered unit and bucket until the next check)."""


class Watchdog:
    """Tracks pending collectives; ``start(timeout_s)`` arms the checking thread."""

    def __init__(self) -> None:
        self.timeout_s: float | None = None
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.rank = 0

    def start(self, timeout_s: float, rank: int) -> None:
        """Arm (or re-arm with a new timeout); idempotent."""
        self.timeout_s, self.rank = float(timeout_s), rank
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="zerotune-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.timeout_s = None

    def begin(self, op: str, ranks: int, nbytes: int) -> int | None:
        """Register a collective about to be issued; returns its token (None when disarmed)."""
        if self.timeout_s is None:
            return None
        token = next(self._ids)
        with self._lock:
            self._pending[token] = _Pending(op, ranks, nbytes, _call_site(), time.monotonic())
        return token

    def issued(self, token: int | None, handle: Any) -> None:
        """The collective is asynchronous: it is pending until its ``handle`` completes (or is dropped)."""
        if token is None:
            return
        with self._lock:
            entry = self._pending.get(token)
            if entry is not None:
                entry.handle = weakref.ref(handle)

    def end(self, token: int | None) -> None:
        if token is not None:
            with self._lock:
                self._pending.pop(token, None)

    def _watch(self) -> None:
        while True:
            time.sleep(0.5 if self.timeout_s is None else min(1.0, self.timeout_s / 10))
            timeout = self.timeout_s
            if timeout is None:
                continue
            now = time.monotonic()
            with self._lock:
                for token, entry in list(self._pending.items()):
                    if entry.handle is not None and _completed(entry.handle()):
                        del self._pending[token]
                overdue = [e for e in self._pending.values() if now - e.started > timeout]
            if overdue:
                self._fire(min(overdue, key=lambda e: e.started), now, timeout)

    def _fire(self, entry: _Pending, now: float, timeout: float) -> None:
        message = (f"zerotune watchdog: rank {self.rank}: {entry.op} over {entry.ranks} ranks ({entry.nbytes} bytes, "
                   f"issued at {entry.site}) has not completed after {now - entry.started:.1f} s (comm_timeout_s "
                   f"is {timeout:g}): another rank stopped, died or issued other collectives. Every thread's Python "
                   f"stack follows; exiting with status {EXIT_STATUS}.\n")
        try:
            sys.stderr.write(message)
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(EXIT_STATUS)


def _completed(handle: Any) -> bool:
    if handle is None:  # dropped unwaited: nobody waits for it any more
        return True
    try:
        return bool(handle.is_completed())
    except Exception:  # noqa: BLE001 - a failed work is not pending: its wait() reports it
        return True


def _call_site() -> str:
    """The first frame outside the collective layer: where zerotune (or the script) issued the collective."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(("distributed/comm.py", "zerotune/comm.py")):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


WATCHDOG = Watchdog()
"""The process's watchdog: collectives are process-global, so is their watchdog."""
