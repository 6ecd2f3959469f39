"""A small data-parallel training run that injects one fault on one rank (for tests/test_faults.py).

    python train.py --fault sigstop|sigkill|raise|extra-collective|save-on-one-rank|skip-raw-collective|none \
        --rank-at-fault 1 --at-step 2 --comm-timeout 10 --guard-interval 1 [--guard-torch-distributed] --marker DIR

(``extra-collective``: the faulty rank all-reduces a tensor of its own the others never all-reduce;
``save-on-one-rank``: it saves a checkpoint the others do not save; ``skip-raw-collective``: every rank
averages its loss with a raw ``torch.distributed.all_reduce`` after each step, and the faulty rank skips
it once. ``--guard-torch-distributed``: the script's own collectives go through the guard.
``--guard-interval``: micro-steps per collective-guard exchange, as the guard sets it where exchanges cost
over 1% of the time.)

Run with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. Before its fault, the faulty rank writes
``DIR/fault_time`` (the wall-clock time), so the test can measure how long the others take to end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zerotune  # noqa: E402
from tests.models import make_mlp, mlp_batch  # noqa: E402
from zerotune.distributed.guard_torch import guard_torch_distributed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["sigstop", "sigkill", "raise", "extra-collective", "save-on-one-rank",
                                            "skip-raw-collective", "none"], default="none")
    parser.add_argument("--guard-torch-distributed", action="store_true")
    parser.add_argument("--guard-interval", type=int, default=1)
    parser.add_argument("--rank-at-fault", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--comm-timeout", type=float, default=600.0)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--marker", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "comm_timeout_s": args.comm_timeout,
              "zero_optimization": {"stage": args.stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
    engine.guards.guard.interval = args.guard_interval
    if args.guard_torch_distributed:
        guard_torch_distributed()
    for step in range(args.steps):
        at_fault = step == args.at_step and engine.global_rank == args.rank_at_fault
        if at_fault and args.fault not in ("none", "skip-raw-collective"):
            Path(args.marker, "fault_time").write_text(repr(time.time()))
            if args.fault == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "extra-collective":
                zerotune.comm.all_reduce(torch.ones(3))
            elif args.fault == "save-on-one-rank":
                engine.save_checkpoint(str(Path(args.marker, "checkpoint")))
            else:
                raise RuntimeError(f"injected failure on rank {engine.global_rank} at step {step}")
        batch = mlp_batch(step, engine.global_rank, 2)
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        if args.fault == "skip-raw-collective":
            if at_fault:
                Path(args.marker, "fault_time").write_text(repr(time.time()))
            else:
                torch.distributed.all_reduce(loss.detach().clone())
    engine.destroy()
    print(f"rank {engine.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
