"""Training with ``checkpoint.auto_resume`` under ``zerotune run --max-restarts`` (tests/test_faults.py).

    zerotune run --standalone --max-restarts 1 --nproc_per_node 2 elastic_train.py --save-dir DIR --out FILE [--kill]

Saves a checkpoint every 2 of 8 steps; with ``--kill`` rank 1 SIGKILLs itself right after the second one on
the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0). Rank 0 writes the final loss and the step it started
from to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zerotune  # noqa: E402
from tests.models import make_mlp, mlp_batch  # noqa: E402

STEPS, EVERY = 8, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "checkpoint": {"save_dir": args.save_dir, "auto_resume": True}}
    engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
    first = engine.global_steps
    loss = None
    for step in range(first, STEPS):
        loss = engine(**mlp_batch(step, engine.global_rank, 2))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % EVERY == 0:
            engine.save_checkpoint()
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if args.kill and restart == 0 and engine.global_steps == 2 * EVERY and engine.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    if engine.global_rank == 0:
        weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        Path(args.out).write_text(json.dumps({"loss": total.item(), "first_step": first,
                                              "weights_sum": weights.double().sum().item()}))
    engine.destroy()


if __name__ == "__main__":
    main()
