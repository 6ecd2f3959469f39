"""``deepspeed.launcher.runner``: DeepSpeed's ``deepspeed`` command, run as ``zerotune run --as-deepspeed``.

``deepspeed [--num_gpus N] [--master_port P] train.py ARGS`` is how most DeepSpeed examples start, and
accelerate's DeepSpeed launcher imports this module for ``DEEPSPEED_ENVIRONMENT_NAME``. One node is
translated to torchrun (one rank per selected device; ``--include localhost:0,2`` also sets the visible
devices); the variables in a ``.deepspeed_env`` file (home directory, then the current one) are exported
to the ranks as DeepSpeed does. Starting ranks on other hosts over pdsh / MPI / SLURM from a hostfile is
DeepSpeed's process management, which zerotune leaves to torchrun and the scheduler: such a request is
refused in one line saying what to run instead, as are the options that only make sense there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "DLTS_HOSTFILE", "parse_args", "main",
           "launch_arguments"]

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
DLTS_HOSTFILE = "/job/hostfile"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

_MULTI_NODE = ("starting ranks on other hosts is left to torchrun and your scheduler: run `zerotune run "
               "--as-deepspeed --nnodes N --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:PORT script.py` on "
               "each node, or under SLURM `srun zerotune run --as-deepspeed ...`")
# options of DeepSpeed's runner that only matter for its multi-node / elastic / tuning machinery
_REFUSED_OPTIONS = {
    "launcher_args": _MULTI_NODE, "no_ssh": _MULTI_NODE, "no_ssh_check": _MULTI_NODE, "force_multi": _MULTI_NODE,
    "ssh_port": _MULTI_NODE, "venv_script": _MULTI_NODE, "min_elastic_nodes": "elastic training",
    "max_elastic_nodes": "elastic training", "elastic_training": "elastic training", "autotuning": "autotuning",
    "bind_cores_to_rank": "binding ranks to cores", "bind_core_list": "binding ranks to cores",
    "save_pid": "the runner's pid file", "enable_each_rank_log": "per-rank log files (torchrun's --log-dir and "
                                                                   "--redirects do it: pass them to zerotune run)",
}


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's runner options (the same names and defaults)."""
    parser = argparse.ArgumentParser(prog="deepspeed", description="DeepSpeed's launcher on zerotune: one node, "
                                     "one rank per device, through torchrun (zerotune run --as-deepspeed)")
    parser.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE)
    parser.add_argument("-i", "--include", type=str, default="")
    parser.add_argument("-e", "--exclude", type=str, default="")
    parser.add_argument("--num_nodes", type=int, default=-1)
    parser.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    parser.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT)
    parser.add_argument("--master_addr", type=str, default="")
    parser.add_argument("--node_rank", type=int, default=-1)
    parser.add_argument("--launcher", type=str, default="pdsh")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--log_level", type=str, default=None)
    parser.add_argument("-q", "--quiet", action="store_true")
    for option in ("launcher_args", "ssh_port", "venv_script", "bind_core_list", "autotuning"):
        parser.add_argument(f"--{option}", type=str, default=None)
    for option in ("min_elastic_nodes", "max_elastic_nodes"):
        parser.add_argument(f"--{option}", type=int, default=-1)
    for flag in ("no_ssh", "no_ssh_check", "force_multi", "save_pid", "enable_each_rank_log", "elastic_training",
                 "bind_cores_to_rank"):
        parser.add_argument(f"--{flag}", action="store_true")
    parser.add_argument("user_script", type=str)
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args)


def _refuse(option: str, why: str) -> SystemExit:
    return SystemExit(f"deepspeed (zerotune): --{option} is not supported: {why}")


def _slots(spec: str, option: str) -> list[int] | None:
    """The device slots of ``localhost:0,2`` (None: the whole host); another host is a multi-node request."""
    if not spec:
        return None
    if "@" in spec:
        raise _refuse(option, _MULTI_NODE)
    host, _, slots = spec.partition(":")
    if host not in ("localhost", "127.0.0.1", os.uname().nodename):
        raise _refuse(option, f"host {host!r} is not this machine; {_MULTI_NODE}")
    try:
        return [int(slot) for slot in slots.split(",")] if slots else None
    except ValueError:
        raise SystemExit(f"deepspeed (zerotune): --{option} {spec!r}: slots must be device numbers, "
                         "as in localhost:0,1") from None


def _device_count() -> int:
    from zerotune.compat.accelerator import get_accelerator

    return max(1, get_accelerator().device_count())


def launch_arguments(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The ``zerotune run`` arguments and the environment additions for DeepSpeed's runner options."""
    for option, why in _REFUSED_OPTIONS.items():
        value = getattr(args, option)
        if value not in (None, False, -1):
            raise _refuse(option, why)
    if args.num_nodes > 1:
        raise _refuse("num_nodes", _MULTI_NODE)
    if args.node_rank > 0:
        raise _refuse("node_rank", _MULTI_NODE)
    if args.hostfile != DLTS_HOSTFILE and os.path.isfile(args.hostfile):
        hosts = [line.split()[0] for line in Path(args.hostfile).read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        if len(hosts) > 1:
            raise _refuse("hostfile", f"{args.hostfile} lists {len(hosts)} hosts; {_MULTI_NODE}")
    if args.no_python:
        raise _refuse("no_python", "the ranks start the DeepSpeed alias before the script, so the script must be "
                                   "Python")
    if args.include and args.exclude:
        raise SystemExit("deepspeed (zerotune): --include and --exclude are mutually exclusive (as in DeepSpeed)")
    devices = list(range(_device_count()))
    included, excluded = _slots(args.include, "include"), _slots(args.exclude, "exclude")
    if included is not None:
        devices = included
    elif args.exclude:
        devices = [] if excluded is None else [d for d in devices if d not in excluded]
    if args.num_gpus > 0:
        devices = devices[:args.num_gpus] if args.include or args.exclude else list(range(args.num_gpus))
    if not devices:
        raise SystemExit("deepspeed (zerotune): no device is left to run on after --include / --exclude")
    environment = _deepspeed_env_file()
    visibility = _accelerator_visibility_variable()
    if (args.include or args.exclude) and visibility is not None:
        environment[visibility] = ",".join(map(str, devices))
    run_args = ["--as-deepspeed", *(["--no_local_rank"] if args.no_local_rank else []),
                "--nproc_per_node", str(len(devices)), "--master_port", str(args.master_port),
                *(["--master_addr", args.master_addr] if args.master_addr else []),
                *(["-m"] if args.module else []), args.user_script, *args.user_args]
    return run_args, environment


def _accelerator_visibility_variable() -> str | None:
    import torch

    return "CUDA_VISIBLE_DEVICES" if torch.cuda.is_available() else None


def _deepspeed_env_file() -> dict[str, str]:
    """``KEY=VALUE`` lines of ``.deepspeed_env`` in the home directory, then the current one (later wins)."""
    found: dict[str, str] = {}
    for directory in DEEPSPEED_ENVIRONMENT_PATHS:
        path = Path(directory) / DEEPSPEED_ENVIRONMENT_NAME
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise SystemExit(f"deepspeed (zerotune): {path} line {number}: expected KEY=VALUE, got {line!r}")
            found[key.strip()] = value.strip()
    return found


def main(args: Sequence[str] | None = None) -> int:
    """The ``deepspeed`` command: parse DeepSpeed's runner options and start ``zerotune run --as-deepspeed``."""
    from zerotune.cli.run import run_launch

    run_args, environment = launch_arguments(parse_args(sys.argv[1:] if args is None else args))
    os.environ.update(environment)
    return run_launch(argparse.Namespace(func=None, rest=run_args))


if __name__ == "__main__":
    sys.exit(main())
