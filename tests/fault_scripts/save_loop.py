"""Trains and saves a checkpoint after every step until it is killed (tests/test_launcher_faults.py).

    zerotune run --standalone --nproc_per_node 2 save_loop.py --save-dir DIR --pid-dir PIDS
    python save_loop.py --save-dir DIR --load      # one process: load what ``latest`` names, print its step

Each rank writes its pid to ``PIDS/rank<N>`` once training started, so the test can watch the ranks after it
kills their launcher. ``--load`` prints ``{"tag": ..., "step": ...}`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zerotune  # noqa: E402
from tests.models import make_mlp, mlp_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--pid-dir")
    parser.add_argument("--load", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 100000, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
    if args.load:
        path, _ = engine.load_checkpoint(args.save_dir)
        print(json.dumps({"tag": Path(path).name, "step": engine.global_steps}), flush=True)
        engine.destroy()
        return
    Path(args.pid_dir).mkdir(parents=True, exist_ok=True)
    Path(args.pid_dir, f"rank{engine.global_rank}").write_text(str(os.getpid()))
    while True:  # until the test kills the launcher
        engine.backward(engine(**mlp_batch(engine.global_steps, engine.global_rank, 2)))
        engine.step()
        engine.save_checkpoint(args.save_dir)


if __name__ == "__main__":
    main()
