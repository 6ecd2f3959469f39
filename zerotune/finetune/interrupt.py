"""Ctrl-C ends a fine-tuning run with one line saying how to resume it, not a traceback from every rank.

A terminal's Ctrl-C reaches the launcher and every rank at once. Left to Python, each rank prints its
``KeyboardInterrupt`` traceback -- or, when the other rank left first, a gloo "connection closed" one --
and nothing says that ``--resume`` continues from the newest checkpoint. So each rank leaves at once and
silently on SIGINT (``leave_quietly_on_interrupt``; a save it was writing stays unpublished and the previous
checkpoint stays whole: ``checkpoint/atomic.py``), and whoever faces the user -- the ``zerotune finetune``
launcher, or rank 0 when started by a plain torchrun -- prints ``resume_hint``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path
from types import FrameType

from zerotune.checkpoint.atomic import LATEST
from zerotune.distributed.launcher_link import INTERRUPTED_STATUS, LAUNCHER_PID_ENV

CHECKPOINTS = "checkpoints"


def resume_command(args: argparse.Namespace) -> str:
    """The ``zerotune finetune`` command line that continues this run from its newest checkpoint."""
    argv = ["zerotune", "finetune", *([args.recipe] if args.recipe else []), "--output-dir", args.output_dir,
            "--resume", *(["--merge"] if args.merge else [])]
    for override in args.overrides:
        argv += ["--set", override]
    return shlex.join(argv)


def resume_hint(args: argparse.Namespace) -> str:
    """One line: where the newest checkpoint is (or that there is none yet) and the command that resumes."""
    latest = Path(args.output_dir) / CHECKPOINTS / LATEST
    if latest.is_file():
        where = f"the newest checkpoint is {latest.parent / latest.read_text().strip()}"
    else:
        where = "no checkpoint was saved yet (train.save_every), so this starts over"
    return f"{where}; resume with: {resume_command(args)}"


def leave_quietly_on_interrupt(args: argparse.Namespace, rank: int) -> None:
    """In a rank: on SIGINT, leave at once with ``INTERRUPTED_STATUS`` -- printing ``resume_hint`` on rank 0 when no
    zerotune launcher will -- wherever the rank is (a rank blocked in a collective leaves when its peer does)."""

    def leave(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        try:
            if rank == 0 and LAUNCHER_PID_ENV not in os.environ:
                print(f"\nzerotune finetune: interrupted (SIGINT); {resume_hint(args)}", file=sys.stderr, flush=True)
            sys.stdout.flush()
        finally:
            os._exit(INTERRUPTED_STATUS)

    signal.signal(signal.SIGINT, leave)
