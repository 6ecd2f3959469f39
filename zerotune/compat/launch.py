"""``python -m zerotune.compat.launch [--no_local_rank] SCRIPT [ARGS...]`` (or ``-m MODULE``): install the
``deepspeed`` alias in this process, then run the script as ``__main__``.

``zerotune run --as-deepspeed`` starts every rank through this module, so an unmodified DeepSpeed
script (``import deepspeed``, ``from deepspeed.accelerator import get_accelerator``, ...) runs on
zerotune. Like DeepSpeed's launcher, it appends ``--local_rank=<LOCAL_RANK>`` to the script's
arguments unless ``--no_local_rank`` is given.
"""

from __future__ import annotations

import os
import runpy
import sys

from zerotune.compat.alias import install_deepspeed_alias

USAGE = "usage: python -m zerotune.compat.launch [--no_local_rank] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    pass_local_rank = True
    if argv and argv[0] == "--no_local_rank":
        pass_local_rank, argv = False, argv[1:]
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit(USAGE)
    target, script_args = argv[0], argv[1:]
    if pass_local_rank:
        script_args.append(f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")
    install_deepspeed_alias()
    sys.argv = [target, *script_args]
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target):
        raise SystemExit(f"zerotune run --as-deepspeed: no script file {target!r}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
