"""What the fault guards cost per step: ZeRO stages 0-3 on 2 gloo ranks, each guard alone and both off, in
the same run -- the collective watchdog (``comm_timeout_s``: every collective registered while pending, a
checking thread) and the collective-sequence guard (``collective_guard``: every collective folded into a
running CRC, one small all-gather on the guard's own group before each micro-step's first phase that
communicates, or before every few micro-steps where those exchanges cost over 1% of the time).

    python benchmarks/bench_fault_overhead.py               # GPT-2 (4 x 256), 30 measured steps per setting
    python benchmarks/bench_fault_overhead.py --steps 3 --width 64 --stages 3   # a quick run

One engine per stage; its steps run in blocks of one setting (off / watchdog / guard) in shuffled order, so
drift of the machine hits all alike; the table gives the median step time of each and the ratios to "off".
Step times on this machine vary by several percent between runs, more than either guard costs, so the table
also gives each guard's cost from what it does per step, as a share of the step: the number held to the
target, under 1%. The watchdog's: its per-collective cost x collectives per step. The guard's: its
per-collective record, plus the time the training thread spends launching its exchanges and waiting for them
once every rank has reached the collective that waits (waiting before that is the ranks' skew, which that
collective would wait out without the guard), measured per exchange in the run (the costlier rank's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp_vs_ddp import _free_port, spawn_ranks, write_gathered  # noqa: E402

SETTINGS = ("off", "watchdog", "guard")
BLOCK = 5  # steps per block of one setting; the first is not timed


def _use(engine, setting: str) -> None:
    """Switch the engine's guards between steps of one run (both ranks alike): the watchdog by its timeout, the
    guard by pausing it (while paused it records and exchanges nothing, on every rank, so its records stay in
    step, and its cost share -- which sets its interval -- counts only the guarded steps)."""
    from zerotune.distributed import comm

    engine.guards.timeout_s = 600.0 if setting == "watchdog" else None
    if setting == "guard":
        engine.guards.guard.resume()
    else:
        with engine.guards.entered():
            comm.settle_guard()  # (an exchange still in flight belongs to the guarded steps)
        engine.guards.guard.pause()


def _step_times(args: argparse.Namespace, stage: int) -> dict:
    """One engine; its steps run in short blocks of one setting each, the blocks in shuffled order, so drift and
    noise hit every setting alike. A block's first step is not timed; its other steps follow each other with
    nothing in between."""
    import zerotune
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                       vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "comm_timeout_s": 600,
              "collective_guard": True, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    guard = engine.guards.guard
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    result: dict = {name: [] for name in SETTINGS}
    timed_per_block = BLOCK - 1
    blocks = [name for name in SETTINGS for _ in range(-(-args.steps // timed_per_block))]
    random.Random(stage).shuffle(blocks)  # the same on both ranks
    for warm_up in SETTINGS:  # one untimed block of each first
        _use(engine, warm_up)
        for _ in range(BLOCK):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    zerotune.comm.reset_comm_stats()
    points, timed_steps, guard_timings = 0, 0, []
    for setting in blocks:
        _use(engine, setting)
        dist.barrier()
        for index in range(BLOCK):
            timed = index > 0
            guard.timings = guard_timings if timed and setting == "guard" else None
            points_before = guard.points
            started = time.perf_counter()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            if timed:
                result[setting].append(time.perf_counter() - started)
                points += guard.points - points_before
                timed_steps += 1
        guard.timings = None
    _use(engine, "guard")
    stats = zerotune.comm.comm_stats()
    result["calls"] = sum(s.calls for s in stats.values()) / (timed_steps + len(blocks))
    result["points"] = points / len(result["guard"])
    timings = guard_timings
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, timings)  # (every rank recorded the same points)
    result["guard_net"] = _net_guard_seconds(everyone, dist.get_rank())
    result["interval"] = guard.interval
    result["guard_wait"] = sum(launch + end - start for _, launch, start, end in timings) / len(result["guard"])
    engine.destroy()
    return result


def _net_guard_seconds(timings: list[list[tuple]], rank: int) -> list[float]:
    """Per guard point, the training thread's time in it that no collective would have spent without the guard:
    launching the exchange, plus waiting for it once every rank has reached the collective that waits for it.
    Waiting before then is the ranks' skew, which that collective waits out when there is no guard."""
    costs = []
    for points in zip(*timings):  # the same guard points, in the same order, on every rank
        last_ready = max(wait_start for _, _, wait_start, _ in points)
        _, launch_s, wait_start, wait_end = points[rank]
        costs.append(launch_s + max(0.0, wait_end - max(wait_start, last_ready)))
    return costs


def _exchange_seconds(count: int = 300) -> float:
    """One guard point's exchange on 2 ranks (both call it back to back, as at a real phase boundary)."""
    from zerotune.distributed import comm
    from zerotune.distributed.guard import GUARD

    GUARD.start([], rank=dist.get_rank())
    for index in range(20):
        comm.guard_point("backward", 0, index)
    started = time.perf_counter()
    for index in range(count):
        comm.guard_point("backward", 0, index)
    seconds = (time.perf_counter() - started) / count
    GUARD.stop()
    return seconds


def _rank_main(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import zerotune

    zerotune.init_distributed()
    try:
        results: dict = {"exchange_s": _exchange_seconds()}
        for stage in args.stages:
            results[str(stage)] = _step_times(args, stage)
        write_gathered(results, out_dir)
    finally:
        dist.destroy_process_group()


def per_collective_costs() -> tuple[float, float]:
    """Seconds each guard adds to one collective: the watchdog's register / hand over / end, and the guard's
    call site + CRC fold (the call site is shared: measured once, charged to both)."""
    from zerotune.distributed.guard import CollectiveGuard, GroupLog, call_site
    from zerotune.distributed.watchdog import Watchdog

    class Handle:
        def is_completed(self) -> bool:
            return False

    watchdog, handle, count = Watchdog(), Handle(), 100_000
    watchdog.start(600.0, 0)
    started = time.perf_counter()
    for _ in range(count):
        token = watchdog.begin("all_gather", 2, 1024, call_site(), timeout_s=600.0)
        watchdog.issued(token, handle)
        watchdog.end(token)
    watchdog_cost = (time.perf_counter() - started) / count
    guard = CollectiveGuard()
    guard._log = lambda group, transfer, log=GroupLog("ranks 0,1", (0, 1)): log  # no process group here: one log
    started = time.perf_counter()
    for _ in range(count):
        guard.record("all_gather", None, torch.float32, 1024, call_site())
    return watchdog_cost, (time.perf_counter() - started) / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per setting")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4),
                        help="ZeRO stages to measure")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (_free_port(), args, out_dir), 2)
        with open(os.path.join(out_dir, "result.json")) as handle:
            per_rank = json.load(handle)
    watchdog_cost, record_cost = per_collective_costs()
    exchange = max(result["exchange_s"] for result in per_rank)
    print(f"fault guards' overhead: GPT-2 ({args.layers} x {args.width}), 2 gloo ranks, {args.steps} steps per setting, "
          "interleaved; median step time of rank 0, ms")
    print("| ZeRO stage | both off | watchdog on | guard on | watchdog / off | guard / off | collectives / step "
          "| guard exchanges / step (micro-steps per exchange at the end) | guard exchange time on the training thread "
          "/ step | of it, past the ranks' skew | watchdog cost / step | guard cost / step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = {"watchdog": 0.0, "guard": 0.0}
    for stage in args.stages:
        measured = per_rank[0][str(stage)]
        off, watchdog, guard = (statistics.median(measured[name]) * 1000 for name in SETTINGS)
        calls, points, waited = measured["calls"], measured["points"], measured["guard_wait"] * 1000
        nets = [result[str(stage)]["guard_net"] for result in per_rank]
        net = max(sum(costs) for costs in nets) / len(measured["guard"]) * 1000  # the costlier rank's
        watchdog_share = calls * watchdog_cost * 1000 / off
        guard_share = calls * record_cost * 1000 / off + net / off
        worst = {"watchdog": max(worst["watchdog"], watchdog_share), "guard": max(worst["guard"], guard_share)}
        print(f"| {stage} | {off:.1f} | {watchdog:.1f} | {guard:.1f} | {watchdog / off:.3f} | {guard / off:.3f} | "
              f"{calls:.0f} | {points:.2f} ({measured['interval']}) | {waited:.3f} ms | {net:.3f} ms | {100 * watchdog_share:.3f}% | "
              f"{100 * guard_share:.3f}% |")
    print(f"per collective: watchdog {watchdog_cost * 1e6:.2f} us, guard record {record_cost * 1e6:.2f} us; one guard "
          f"exchange {exchange * 1e6:.0f} us back to back. Largest share of a step: watchdog "
          f"{100 * worst['watchdog']:.3f}%, guard {100 * worst['guard']:.3f}% (target < 1% each; the measured ratios "
          "carry this machine's step-time noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
