"""A rank's ties to the zerotune launcher that started it: it dies with the launcher, and it leaves its error
where the launcher reads it.

Dying with the launcher: ``zerotune run`` and ``zerotune finetune`` drive torchrun's agent in their own process,
so the agent is the ranks' parent. Killed with SIGKILL (an OOM killer, ``kill -9``, a lost SSH session), it
cannot tear its ranks down, and they would go on training and saving while a relaunch starts a second job in
the same checkpoint directory. So the launcher names itself in ``LAUNCHER_PID_ENV`` (``mark_launcher``) and each
rank, in ``init_distributed``, asks the kernel for SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``) --
or, where that is unavailable or the launcher is not its parent, watches the launcher's pid once a second.
A SIGKILL mid-save is safe: checkpoints are written into a staging directory and published by renames
(``checkpoint/atomic.py``), so the previous tag and ``latest`` stay loadable.

Leaving its error: torchrun reads a failed rank's ``TORCHELASTIC_ERROR_FILE`` (JSON, the format of
``torch.distributed.elastic``'s ``ErrorHandler``) into its ``ChildFailedError``; a plain script never writes
it, so the launcher could only say "exit code 1". ``record_error`` writes it, from an uncaught exception
(``sys.excepthook``) or from the watchdog before it ends the process, so the launcher can print which rank
failed first and its one-line error (``cli/failures.py``).

Only ranks started by a zerotune launcher do either: importing zerotune, or ``init_distributed`` under a
plain ``torchrun``, changes nothing.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from types import TracebackType

LAUNCHER_PID_ENV = "ZEROTUNE_LAUNCHER_PID"
WATCH_INTERVAL_S = 1.0
"""How often a rank whose launcher is not its parent (or without ``PR_SET_PDEATHSIG``) looks for it."""
EXIT_STATUS = 137
"""The status a rank that outlived its launcher leaves with (as if SIGKILLed, which is what the kernel does)."""
INTERRUPTED_STATUS = 130
"""A launcher's or rank's exit status after a Ctrl-C or a termination signal (128 + SIGINT, as shells report)."""
_PR_SET_PDEATHSIG = 1
_bound = False
_exiting = threading.Event()


def mark_launcher() -> None:
    """In the launcher, before it starts ranks: they inherit this process's pid in their environment."""
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())


def bind_to_launcher() -> None:
    """In a rank started by a zerotune launcher: die with the launcher, and record an uncaught exception where
    the launcher reads it. Idempotent; nothing happens outside a zerotune launcher."""
    global _bound
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    if _bound or not value.isdigit():
        return
    _bound = True
    launcher = int(value)
    if not (os.getppid() == launcher and _kernel_kills_on_parent_death()):
        watcher = threading.Thread(target=_watch, args=(launcher,), name="zerotune-launcher-watch", daemon=True)
        watcher.start()
        atexit.register(_stop_watching, watcher)
    previous = sys.excepthook

    def record_then_report(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        record_error(one_line(value), "".join(traceback.format_exception(kind, value, tb)))
        previous(kind, value, tb)

    sys.excepthook = record_then_report


def _kernel_kills_on_parent_death() -> bool:
    """Ask Linux for SIGKILL when the parent dies; False where prctl is unavailable. The parent may have died
    before the request: then the kernel will not send it, so check again after."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    launcher = int(os.environ[LAUNCHER_PID_ENV])
    if os.getppid() != launcher:  # reparented between the two calls: the launcher is already gone
        _leave(launcher)
    return True


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _watch(launcher: int) -> None:
    parent = os.getppid()
    while not _exiting.wait(WATCH_INTERVAL_S):
        if not is_alive(launcher) or os.getppid() != parent:
            _leave(launcher)


def _stop_watching(watcher: threading.Thread) -> None:
    """At interpreter exit, end the thread before finalization does (as the watchdog's ``_join``: a daemon thread
    stopped by finalization mid-wait can abort the process)."""
    _exiting.set()
    watcher.join(timeout=2 * WATCH_INTERVAL_S)


def _leave(launcher: int) -> None:
    try:
        sys.stderr.write(f"zerotune: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher (pid "
                         f"{launcher}) is gone; exiting\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr was a pipe to the launcher
        pass
    os._exit(EXIT_STATUS)


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` -- what a summary shows of an error."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def record_error(message: str, details: str) -> None:
    """Write this rank's error where torchrun's agent reads it (``TORCHELASTIC_ERROR_FILE``), in the format of
    its ``ErrorHandler``; ``time`` (seconds, not whole ones) orders ranks that failed in the same second."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or LAUNCHER_PID_ENV not in os.environ:
        return
    now = time.time()
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": details, "timestamp": str(int(now)), "time": now}}}
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError:  # the launcher's log directory is gone: nobody will read it
        pass
