"""Peak memory of training with ZeRO-Infinity (parameters and optimizer state on NVMe), one run.

    python benchmarks/bench_offload_memory.py                       # ~300M parameters, bf16 + AdamW
    python benchmarks/bench_offload_memory.py --layers 4 --steps 2  # smoke test

Workload: an MLP of ``--layers`` Linear(``--width``, ``--width``) layers (36 x 2880: 298.7M
parameters) built under ``zerotune.zero.Init``, bf16 with fp32 masters and AdamW -- model states of
16 bytes per parameter (the ZeRO paper's 16Psi: 4.8 GB here) -- trained on one rank, ZeRO stage 3,
batch of 8 rows. Methods, each in a fresh process so its peak RSS is its own:

* ``plain``: stage 3 with everything in memory (the baseline);
* ``nvme``: ``offload_param`` and ``offload_optimizer`` on NVMe (swap files in ``--dir``), optimizer
  stepped in ``sub_group_size`` chunks through ``buffer_count`` buffers.

Peak RSS is the process's high-water mark (VmHWM) over the whole run, set-up included, with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers go back to the system and RSS tracks live memory.
Printed: peak RSS, 16Psi / peak RSS (target >= 3 for ``nvme``), median step time and its ratio to
``plain``. The two runs' losses must agree (offload changes where state lives, never the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_method(args: argparse.Namespace) -> dict:
    """One method in this (fresh) process: build, train ``args.steps`` steps, report."""
    import zerotune

    torch.set_num_threads(1)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
            "reduce_bucket_size": args.width * args.width, "sub_group_size": args.sub_group_size}
    if args.method == "nvme":
        shard = args.width * args.width + args.width  # one layer's shard (a unit) on one rank
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.dir, "buffer_count": 3, "buffer_size": shard}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.dir, "buffer_count": 4}
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    torch.manual_seed(0)
    with zerotune.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential()
        for _ in range(args.layers):  # appended one by one: each layer is partitioned as it is registered
            model.append(torch.nn.Linear(args.width, args.width))
    engine, *_ = zerotune.initialize(model=model, config=config)
    psi = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(args.steps):
        x = torch.randn(8, args.width, generator=generator)
        started = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    engine.destroy()
    return {"psi": psi, "peak_rss": _peak_rss_bytes(), "losses": losses,
            "step_s": statistics.median(times[1:] or times)}


def _child(method: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, os.path.abspath(__file__), "--child", method, "--layers", str(args.layers),
               "--width", str(args.width), "--steps", str(args.steps), "--sub-group-size", str(args.sub_group_size),
               "--dir", args.dir]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--width", type=int, default=2880)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub-group-size", type=int, default=10**7)
    parser.add_argument("--dir", default=None, help="swap directory (default: a temporary one on /tmp's disk)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.method = args.child
        print(json.dumps(run_method(args)))
        return
    with tempfile.TemporaryDirectory(prefix="zerotune-nvme-", dir=args.dir) as directory:
        args.dir = directory
        results = {method: _child(method, args) for method in ("plain", "nvme")}
    psi = results["plain"]["psi"]
    states = 16 * psi
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): {psi / 1e6:.1f}M parameters, bf16 + AdamW, "
          f"1 rank, model states 16Psi = {states / 2**30:.2f} GiB; {args.steps} steps")
    print(f"{'method':8} {'peak RSS MiB':>13} {'16Psi / RSS':>12} {'step s':>8} {'x plain':>8}")
    for method, result in results.items():
        print(f"{method:8} {result['peak_rss'] / 2**20:13.0f} {states / result['peak_rss']:12.2f} "
              f"{result['step_s']:8.2f} {result['step_s'] / results['plain']['step_s']:8.2f}")
    same = results["plain"]["losses"] == results["nvme"]["losses"]
    print(f"nvme: 16Psi / peak RSS = {states / results['nvme']['peak_rss']:.2f} (target >= 3); "
          f"losses identical to plain: {same}")


if __name__ == "__main__":
    main()
