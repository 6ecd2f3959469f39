"""``zerotune run``: a thin wrapper over torchrun (``torch.distributed.run``).

zerotune has no process management of its own: every torchrun option works as documented
(``--nproc_per_node``, ``--nnodes``, ``--rdzv_backend c10d --rdzv_endpoint host:port`` for
multi-node, ...). The wrapper only sets one thread per rank on CPU-only machines unless
OMP_NUM_THREADS is already set, since several ranks sharing cores otherwise oversubscribe them.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed import run as torchrun


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", add_help=False,
        help="launch a training script on several ranks (all torchrun options accepted)",
        description="zerotune run [torchrun options] script.py [script args]",
    )
    parser.set_defaults(func=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    torchrun_args = list(args.rest)
    if not torchrun_args or torchrun_args[0] in ("-h", "--help"):
        torchrun.get_args_parser().print_help()
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun.run(torchrun.parse_args(torchrun_args))
    return 0
