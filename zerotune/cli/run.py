"""``zerotune run``: a thin wrapper over torchrun (``torch.distributed.run``).

zerotune has no process management of its own: every torchrun option works as documented
(``--nproc_per_node``, ``--nnodes``, ``--rdzv_backend c10d --rdzv_endpoint host:port`` for
multi-node, ...). The wrapper only sets one thread per rank on CPU-only machines unless
OMP_NUM_THREADS is already set, since several ranks sharing cores otherwise oversubscribe them.

Two options of its own, given before the script: ``--as-deepspeed`` starts every rank through
``zerotune.compat.launch``, which installs the ``deepspeed`` import alias before the script runs
(and passes ``--local_rank`` as DeepSpeed's launcher does; ``--no_local_rank`` turns that off).

A failed job ends with a short summary (the rank that failed first, its one-line error, where the full
tracebacks and torchrun's report were written: ``failures.py``), and ranks die with this process when it
is killed (``distributed/launcher_link.py``).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed import run as torchrun

from zerotune.cli.failures import launch_ranks

OWN_FLAGS = ("--as-deepspeed", "--no_local_rank")


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", add_help=False,
        help="launch a training script on several ranks (all torchrun options accepted; --as-deepspeed "
             "runs an unmodified DeepSpeed script)",
        description="zerotune run [--as-deepspeed [--no_local_rank]] [torchrun options] script.py [script args]",
    )
    parser.set_defaults(func=run_launch)


def _split_own_flags(argv: list[str]) -> tuple[set[str], list[str]]:
    """zerotune's flags among the launcher options (before the script), and the rest for torchrun.
    torchrun's own parser finds the script, so option values (``--nproc_per_node 2``) are not mistaken
    for it; a flag after the script belongs to the script."""
    cleaned = [arg for arg in argv if arg not in OWN_FLAGS]
    try:
        script = torchrun.parse_args(cleaned).training_script
    except SystemExit:
        return set(), argv  # torchrun will report the bad option itself
    script_at = next((i for i, arg in enumerate(argv) if arg == script), len(argv))
    own = {arg for arg in argv[:script_at] if arg in OWN_FLAGS}
    return own, [arg for arg in argv[:script_at] if arg not in OWN_FLAGS] + argv[script_at:]


def run_launch(args: argparse.Namespace) -> int:
    own, torchrun_args = _split_own_flags(list(args.rest))
    if not torchrun_args or torchrun_args[0] in ("-h", "--help"):
        print(__doc__)
        torchrun.get_args_parser().print_help()
        return 0
    if "--no_local_rank" in own and "--as-deepspeed" not in own:
        raise SystemExit("zerotune run: --no_local_rank only applies with --as-deepspeed")
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    parsed = torchrun.parse_args(torchrun_args)
    if "--as-deepspeed" in own:
        if parsed.no_python:
            raise SystemExit("zerotune run: --as-deepspeed runs a Python script; it cannot be combined with "
                             "--no-python")
        launch_args = (["--no_local_rank"] if "--no_local_rank" in own else []) + (["-m"] if parsed.module else [])
        parsed.training_script_args = [*launch_args, parsed.training_script, *parsed.training_script_args]
        parsed.training_script, parsed.module = "zerotune.compat.launch", True
    return launch_ranks(parsed, "zerotune run")
