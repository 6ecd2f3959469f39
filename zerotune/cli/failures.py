"""Run torchrun's agent in this process and end with a short summary, not torchrun's traceback wall.

Uncaught, a failed job ends with torchrun's ``ChildFailedError``: this process's traceback through the
agent plus a 30-line report, below which the rank's own one-line error has scrolled away. Here the report
goes to a file and the last lines on the terminal say which rank failed first, its one-line error (which the
ranks record for the agent: ``distributed/launcher_link.py``) and where the full tracebacks are. A Ctrl-C
(or SIGTERM / SIGHUP) ends with one line too; the caller may add how to resume.

Both ``zerotune run`` and ``zerotune finetune`` launch through ``launch_ranks``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from zerotune.distributed.launcher_link import INTERRUPTED_STATUS, mark_launcher
from zerotune.distributed.watchdog import EXIT_STATUS as WATCHDOG_EXIT_STATUS

REPORT = "failure.txt"
SHOWN_CHARS = 160
"""A rank's error in the summary is cut to this many characters (its whole message is in the report)."""


def launch_ranks(parsed: argparse.Namespace, prog: str, on_interrupt: Callable[[], str] | None = None) -> int:
    """``torchrun.run(parsed)``; returns 0, 1 after a rank failed (summary printed) or ``INTERRUPTED_STATUS`` after a
    signal (one line, ending with ``on_interrupt()``'s hint if given). Ranks' error files go under ``parsed.log_dir``
    (a new temporary directory unless given), with the report beside them."""
    if not parsed.log_dir:
        parsed.log_dir = tempfile.mkdtemp(prefix=f"{prog.replace(' ', '-')}-")
    mark_launcher()
    try:
        torchrun.run(parsed)
    except ChildFailedError as error:
        report = Path(parsed.log_dir) / REPORT
        report.write_text(error.format_msg() + "\n")
        print("\n".join(summary_lines(prog, error.failures, report)), file=sys.stderr)
        return 1
    except (SignalException, KeyboardInterrupt) as error:
        name = signal.Signals(error.sigval).name if isinstance(error, SignalException) else "SIGINT"
        after = on_interrupt() if on_interrupt is not None else "every rank was stopped"
        print(f"{prog}: interrupted ({name}); {after}", file=sys.stderr)
        return INTERRUPTED_STATUS
    return 0


def summary_lines(prog: str, failures: dict[int, Any], report: Path) -> list[str]:
    """The first failed rank and its one-line error; then, in one line, how the other ranks ended; then where
    the tracebacks and the full report are. ``failures``: global rank -> torchrun's ``ProcessFailure``."""
    ordered = sorted(failures.items(), key=lambda item: (_is_consequence(item[1]), _failed_at(item[1])))
    (rank, first), others = ordered[0], ordered[1:]
    lines = [f"{prog}: rank {rank} failed first (pid {first.pid}): {_cut(_what(first))}"]
    if others:
        lines.append(f"{prog}: then " + "; ".join(f"rank {r}: {_cut(_what(f))}" for r, f in others))
    if first.error_file and os.path.isfile(first.error_file):
        lines.append(f"{prog}: every failed rank's traceback and torchrun's report: {report}")
    else:
        lines.append(f"{prog}: rank {rank}'s traceback, if it printed one, is in its output above; torchrun's report: "
                     f"{report}")
    return lines


def _cut(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_consequence(failure: Any) -> bool:
    """A failure another one causes: the agent's SIGTERM to the ranks left, a collective failing because a peer
    left (``CommError``). Such a rank may end in the same second as the cause, so it never sorts first."""
    return failure.exitcode == -signal.SIGTERM or _what(failure).startswith("CommError")


def _failed_at(failure: Any) -> float:
    """When the rank failed: the precise time it recorded, else the end of torchrun's whole second (the agent
    noticed it within that second, so it sorts after a rank that recorded a time in the same second)."""
    message = failure.message
    if isinstance(message, dict):
        recorded = message.get("extraInfo", {}).get("time")
        if isinstance(recorded, (int, float)):
            return float(recorded)
    return float(failure.timestamp) + 1.0


def _what(failure: Any) -> str:
    if isinstance(failure.message, dict):
        return str(failure.message.get("message", "")).strip() or f"exit status {failure.exitcode}"
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    if failure.exitcode == WATCHDOG_EXIT_STATUS:
        return f"was ended by the watchdog (exit status {WATCHDOG_EXIT_STATUS}: a collective outlived comm_timeout_s)"
    return f"exited with status {failure.exitcode} (it recorded no error)"
