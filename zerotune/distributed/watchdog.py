"""The collective watchdog: a collective still pending after ``comm_timeout_s`` ends the process, loudly.

A rank that stops (SIGSTOP, a debugger, a hung data loader, a deadlock in user code) leaves the others
waiting inside a collective until torch's own timeout -- 30 minutes by default -- and then fails with a
message from deep inside gloo / NCCL. Every collective passes through ``comm.run_collective``, which
registers it here while it is pending (a blocking call until it returns, an asynchronous one until its
work completes). A daemon thread looks once a second: past the timeout it prints which collective is
pending (op, group size, bytes, the zerotune call site, how long) and every thread's Python stack, then
ends the process with exit status ``EXIT_STATUS``, so a launcher (torchrun) tears the job down. The same
thread lets a rank stalled for a few seconds compare notes with the other stalled ranks
(``guard_stall.py``): ranks deadlocked by diverging collectives end with ``CollectiveMismatch`` in
seconds, not after the timeout.

One thread serves every engine of the process: each pending collective carries its engine's timeout and
collective guard (``guard_scope.py`` finds them), so two engines with different ``comm_timeout_s`` each keep
their own, and an engine without one (``comm_timeout_s: null``) registers nothing.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from zerotune.distributed.guard_stall import SPREAD_S, StallNotes
from zerotune.distributed.launcher_link import record_error

EXIT_STATUS = 75
"""Exit status of a process the watchdog ended (EX_TEMPFAIL: a restart may succeed)."""
MISMATCH_EXIT_STATUS = 1
"""Exit status of a process stalled by diverging collectives (a bug in the script: a restart repeats it)."""


@dataclass
class _Pending:
    op: str
    ranks: int
    nbytes: int
    site: str
    started: float
    timeout_s: float
    """Its engine's ``comm_timeout_s``."""
    guard: Any = None
    """Its engine's ``CollectiveGuard`` (whose notes a stall compares), or None."""
    record: tuple[str, int] | None = None
    """(group, index) of this collective in the collective guard's record."""
    phase: str | None = None
    """For a collective guard exchange: the phase it precedes."""
    handle: Any = None
    """A weak reference to the ``comm.Handle`` of an asynchronous collective (the watchdog must not keep its
    buffers alive: that would hold every gathered unit and bucket until the next check)."""


class Watchdog:
    """Tracks pending collectives, each with its own timeout; ``start`` runs the checking thread."""

    def __init__(self) -> None:
        self._tick_s = 1.0  # between checks: a tenth of the shortest timeout started, at most a second
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._exiting = threading.Event()
        self._stall_notes = StallNotes()
        self.rank = 0

    def start(self, timeout_s: float, rank: int) -> None:
        """Run the checking thread (idempotent), checking often enough for collectives with ``timeout_s``."""
        self.rank = rank
        self._tick_s = min(self._tick_s, float(timeout_s) / 10)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="zerotune-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self._join)

    def _join(self) -> None:
        """At interpreter exit, end the thread before finalization does: a daemon thread that finalization
        stops mid-wait aborts the process ("terminate called without an active exception", exit -6) about
        one exit in three under torch 2.13."""
        self._exiting.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def begin(self, op: str, ranks: int, nbytes: int, site: str, record: tuple[str, int] | None = None,
              phase: str | None = None, *, timeout_s: float | None, guard: Any = None) -> int | None:
        """Register a collective about to be issued from ``site`` by an engine with ``timeout_s`` (None: not
        watched) and collective ``guard``; returns its token (None when not watched)."""
        if timeout_s is None:
            return None
        token = next(self._ids)
        with self._lock:
            self._pending[token] = _Pending(op, ranks, nbytes, site, time.monotonic(), timeout_s, guard, record, phase)
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
            if self._stall_notes.published == token:
                self._stall_notes.withdraw(token)

    def _watch(self) -> None:
        while True:
            if self._exiting.wait(self._tick_s):
                return
            now = time.monotonic()
            with self._lock:
                for token, entry in list(self._pending.items()):
                    if entry.handle is not None and _completed(entry.handle()):
                        del self._pending[token]
                overdue = [e for e in self._pending.values() if now - e.started > e.timeout_s]
                oldest: tuple[int | None, _Pending | None] = min(self._pending.items(), default=(None, None),
                                                                 key=lambda item: item[1].started)
            if overdue:
                self._fire(min(overdue, key=lambda e: e.started), now)
            oldest_token, oldest_entry = oldest
            waited = now - oldest_entry.started if oldest_entry is not None else 0.0
            try:
                verdict = self._stall_notes.tick(oldest_token, oldest_entry, waited)
            except Exception:  # noqa: BLE001 - the store's trouble is never a reason to end a run
                verdict = None
            if verdict is not None:
                self._fire_mismatch(verdict)

    def _fire(self, entry: _Pending, now: float) -> None:
        timeout = entry.timeout_s
        message = (f"zerotune watchdog: rank {self.rank}: {entry.op} over {entry.ranks} ranks ({entry.nbytes} bytes, "
                   f"issued at {entry.site}) has not completed after {now - entry.started:.1f} s (comm_timeout_s "
                   f"is {timeout:g}): another rank stopped, died or issued other collectives. Every thread's Python "
                   f"stack follows; exiting with status {EXIT_STATUS}.\n")
        try:
            record_error(f"watchdog: {entry.op} issued at {entry.site} did not complete within comm_timeout_s "
                         f"({timeout:g} s)", message + "(every thread's stack: in this rank's output)")
            sys.stderr.write(message)
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        finally:
            os._exit(EXIT_STATUS)


    def _fire_mismatch(self, verdict: str) -> None:
        try:
            record_error(f"CollectiveMismatch: {verdict.splitlines()[0]}", verdict)
            sys.stderr.write(f"zerotune collective guard: rank {self.rank}: CollectiveMismatch: {verdict}\n"
                             f"exiting with status {MISMATCH_EXIT_STATUS}.\n")
            sys.stderr.flush()
            time.sleep(SPREAD_S)  # the other stalled ranks read the verdict from the store meanwhile
        finally:
            os._exit(MISMATCH_EXIT_STATUS)


def _completed(handle: Any) -> bool:
    if handle is None:  # dropped unwaited: nobody waits for it any more
        return True
    try:
        return bool(handle.is_completed())
    except Exception:  # noqa: BLE001 - a failed work is not pending: its wait() reports it
        return True


WATCHDOG = Watchdog()
"""The process's watchdog thread, serving every engine's collectives with that engine's timeout."""
