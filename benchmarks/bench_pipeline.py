"""Pipeline parallelism: measured bubble and per-stage activation memory vs theory, GPipe and 1F1B.

    python benchmarks/bench_pipeline.py                    # defaults below, 2 stages on 2 gloo ranks
    python benchmarks/bench_pipeline.py --width 32 --rows 4 --layers 4 --micro-batches 2 4 --steps 1 --warmup 0

Workload: a ``PipelineModule`` of ``--layers`` equal residual blocks ``x + tanh(Linear(x))``
(width ``--width``, so the "parameters" partition gives each stage the same number of blocks),
MSE loss against random targets, fp32, ``--rows`` rows per micro-batch (the default 128 x 1024
makes one micro-batch's forward through one 4-block stage take ~20 ms on one core), SGD, ZeRO
stage 0, one thread per rank, one stage per rank. M = ``gradient_accumulation_steps`` =
micro-batches per ``train_batch``. Default P = 2 stages: this machine has 2 cores, and 4 stages
on 2 cores would time-share the cores, so a stage's "idle" time would include waiting for a
core and its compute intervals would stretch -- the bubble would be the scheduler's, not the
pipeline's. More stages than cores are allowed but flagged.

For each schedule (gpipe, 1f1b) and each M: ``--warmup`` untimed batches, ``--steps`` timed
batches, then one memory batch (hooks add overhead, so it is not timed). Measures, per stage:

- **bubble**: ``engine.timeline`` lists each forward / backward computation of the last batch
  (``time.perf_counter``, one clock for all processes of a machine, waits for neighbours
  excluded); the timelines are gathered to rank 0 (``all_gather_object``). The batch span runs
  from the earliest start to the latest end over all stages; a stage's bubble is
  1 - (its compute time) / span, averaged over the timed batches. Theory: (P-1)/(M+P-1), for
  both schedules. The theory assumes equal stages and free communication; the measurement counts
  as idle the p2p transfers (gloo send / receive and the copies around them) and the data
  iterator reads, and the last stage also computes the loss (slightly longer than the others).
  The loss broadcast, gradient sync and optimizer step come after the last backward: outside the
  span, so not in the bubble (in a real step they add to the time the pipeline does no work).
- **activation memory**: the distinct non-parameter storages autograd saves for backward
  (a ``saved_tensors_hooks`` pack hook; a storage counts from its first save until autograd
  releases its last saved reference), the most held at once during ``train_batch``. One
  micro-batch's activations = all distinct bytes saved in the batch / M (micro-batches are equal).
  Theory: peak = in-flight x per-micro-batch, in-flight = ``max_in_flight(build_schedule(...))``:
  M for GPipe, P - s (<= P) for 1F1B on stage s. The stage output the engine keeps for the
  backward (not saved by autograd here: the residual add saves nothing) is not counted.
  Alongside, **alloc peak**: the most tensor bytes ``train_batch`` allocated at once
  (``tests/memory_probe.PeakTensorBytes``: the activations plus what the backward allocates on the
  way -- output and weight gradients before they are accumulated -- and the received buffers; the
  parameters, gradient buffers and optimizer state exist before the batch and are excluded).

Exits nonzero if a stage's activation peak is not in-flight x per-micro-batch (within 1%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_dp_vs_ddp import _free_port, spawn_ranks, write_gathered

from tests.memory_probe import PeakTensorBytes
from zerotune.pipe.schedule import build_schedule, max_in_flight

SCHEDULES = ("gpipe", "1f1b")
MEMORY_TOLERANCE = 0.01

Timeline = list[tuple[str, int, float, float]]


# ----------------------------------------------------------------------------- workload


class ResidualBlock(nn.Module):
    """``x + tanh(Linear(x))``: every layer the same size and cost, so stages balance exactly."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def _mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, labels)


def new_pipe(args: argparse.Namespace) -> nn.Module:
    from zerotune.pipe import LayerSpec, PipelineModule

    return PipelineModule([LayerSpec(ResidualBlock, args.width) for _ in range(args.layers)],
                          num_stages=args.stages, loss_fn=_mse, seed_layers=True, base_seed=0)


def engine_config(args: argparse.Namespace, schedule: str, micro_batches: int) -> dict:
    return {"train_micro_batch_size_per_gpu": args.rows, "gradient_accumulation_steps": micro_batches,
            "zero_optimization": {"stage": 0}, "pipeline": {"schedule": schedule},
            "optimizer": {"type": "SGD", "params": {"lr": 1e-4}}}


def micro_batch_iter(args: argparse.Namespace, micro_batches: int, step: int) -> Iterator:
    """The batch's (inputs, labels) micro-batches, the same on every rank (seeded by step)."""
    generator = torch.Generator().manual_seed(step)
    return iter([(torch.randn(args.rows, args.width, generator=generator),
                  torch.randn(args.rows, args.width, generator=generator)) for _ in range(micro_batches)])


# ----------------------------------------------------------------------------- measures


class SavedActivations:
    """Context manager: bytes of distinct non-parameter storages autograd holds for backward.

    The pack hook wraps each saved tensor in a ``_Saved`` holder; autograd drops the holder when
    it releases the saved variable (after the node's backward), and a finalizer then decrements
    the storage's count. ``peak`` is the most bytes held at once, ``total`` the bytes of every storage
    each time it starts being held (storage pointers cannot be reused while a count holds them alive)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._counts: dict[int, int] = {}
        self._live = self.peak = self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
        if pointer in self._params or nbytes == 0:
            return tensor
        if self._counts.get(pointer, 0) == 0:
            self._live += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self._live)
        self._counts[pointer] = self._counts.get(pointer, 0) + 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._release, pointer, nbytes)
        return holder

    def _release(self, pointer: int, nbytes: int) -> None:
        self._counts[pointer] -= 1
        if self._counts[pointer] == 0:
            del self._counts[pointer]
            self._live -= nbytes


class _Saved:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def measure_config(args: argparse.Namespace, schedule: str, micro_batches: int) -> dict[str, Any]:
    """This rank's timelines of the timed batches and its memory batch's numbers, for one (schedule, M)."""
    import zerotune

    engine, *_ = zerotune.initialize(model=new_pipe(args), config=engine_config(args, schedule, micro_batches))
    step, timelines = 0, []
    for index in range(args.warmup + args.steps):
        engine.train_batch(micro_batch_iter(args, micro_batches, step))
        step += 1
        if index >= args.warmup:
            timelines.append(list(engine.timeline))
    with PeakTensorBytes() as probe, SavedActivations(list(engine.module.parameters())) as saved:
        engine.train_batch(micro_batch_iter(args, micro_batches, step))
    in_flight = max_in_flight(build_schedule(schedule, micro_batches, args.stages, engine.stage_id))
    return {"stage": engine.stage_id, "timelines": timelines, "saved_peak": saved.peak,
            "per_micro_batch": saved.total / micro_batches, "alloc_peak": probe.peak, "in_flight": in_flight}


def _rank_main(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.stages), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zerotune

    zerotune.init_distributed()
    try:
        results = [{"schedule": schedule, "micro_batches": m, **measure_config(args, schedule, m)}
                   for schedule in SCHEDULES for m in args.micro_batches]
        write_gathered(results, out_dir)
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace) -> list[list[dict]]:
    """Per rank (= stage), per (schedule, M): what ``measure_config`` returned."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (_free_port(), args, out_dir), args.stages)
        with open(os.path.join(out_dir, "result.json")) as handle:
            return json.load(handle)


# ----------------------------------------------------------------------------- bubble arithmetic


def theory_bubble(micro_batches: int, stages: int) -> float:
    """GPipe's and 1F1B's idle fraction per stage with equal stages and free communication."""
    return (stages - 1) / (micro_batches + stages - 1)


def stage_bubbles(timelines: list[Timeline]) -> list[float]:
    """Per stage, 1 - busy / span of one batch, given every stage's timeline of that batch."""
    starts = [start for timeline in timelines for _, _, start, _ in timeline]
    ends = [end for timeline in timelines for _, _, _, end in timeline]
    span = max(ends) - min(starts)
    return [1.0 - sum(end - start for _, _, start, end in timeline) / span for timeline in timelines]


def mean_bubbles(per_stage_timelines: list[list[Timeline]]) -> list[float]:
    """Per stage, the mean bubble over batches; ``per_stage_timelines[stage][batch]``."""
    per_batch = [stage_bubbles(list(batch)) for batch in zip(*per_stage_timelines)]
    return [statistics.mean(column) for column in zip(*per_batch)]


def replay_span(schedule: str, timelines: list[Timeline]) -> float:
    """The span of one batch if every action took its measured time and nothing else took any: each
    stage's actions in schedule order, a forward after the previous stage's forward of that
    micro-batch, a backward after the next stage's backward of it. Measured span - replayed span
    is what the pipeline lost to communication and other overheads (the theory's missing terms);
    replayed bubble - theory is what unequal or varying compute times cost."""
    stages = len(timelines)
    micro_batches = sum(1 for kind, *_ in timelines[0] if kind == "forward")
    durations = [{(kind, m): end - start for kind, m, start, end in timeline} for timeline in timelines]
    orders = [build_schedule(schedule, micro_batches, stages, stage) for stage in range(stages)]
    done: dict[tuple[int, str, int], float] = {}
    position, free = [0] * stages, [0.0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            action = orders[s][position[s]]
            neighbour = s - 1 if action.kind == "forward" else s + 1
            if 0 <= neighbour < stages:
                if (neighbour, action.kind, action.micro_batch) not in done:
                    continue
                ready = done[(neighbour, action.kind, action.micro_batch)]
            else:
                ready = 0.0
            free[s] = max(free[s], ready) + durations[s][(action.kind, action.micro_batch)]
            done[(s, action.kind, action.micro_batch)] = free[s]
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule's stage orders are inconsistent (replay stalled)")
    return max(free)


def replay_bubbles(schedule: str, per_stage_timelines: list[list[Timeline]]) -> tuple[list[float], float]:
    """Per stage, the mean bubble with the replayed span; and the mean measured span / replayed span."""
    bubbles, stretch = [], []
    for batch in zip(*per_stage_timelines):
        span = replay_span(schedule, list(batch))
        bubbles.append([1.0 - sum(end - start for *_, start, end in timeline) / span for timeline in batch])
        measured = max(end for t in batch for *_, end in t) - min(start for t in batch for _, _, start, _ in t)
        stretch.append(measured / span)
    return [statistics.mean(column) for column in zip(*bubbles)], statistics.mean(stretch)


def _mean_duration(timelines: list[Timeline], kind: str) -> float:
    return statistics.mean(end - start for timeline in timelines for k, _, start, end in timeline if k == kind)


# ----------------------------------------------------------------------------- report


def _mib(n: float) -> float:
    return n / 2**20


def report(per_rank: list[list[dict]], args: argparse.Namespace) -> list[str]:
    """Print the tables; return the failures (activation peak != in-flight x per-micro-batch)."""
    failures: list[str] = []
    cores = os.cpu_count() or 1
    params = args.layers * (args.width * args.width + args.width)
    print(f"PipelineModule: {args.layers} x (x + tanh(Linear {args.width}x{args.width})) = {params / 1e6:.2f}M params, "
          f"MSE, fp32, micro-batch {args.rows} rows, P = {args.stages} stages on {args.stages} gloo ranks "
          f"(1 thread each, {cores} cores), {args.steps} timed batches after {args.warmup} warm-up")
    if args.stages > cores:
        print(f"WARNING: {args.stages} stages on {cores} cores oversubscribe the CPU: the timings (and the bubble) "
              "include waiting for a core")
    print(f"\n{'schedule':<9}{'M':>3}{'stage':>6}{'fwd ms':>8}{'bwd ms':>8}{'bubble':>8}{'theory':>8}{'meas/th':>8}"
          f"{'replay':>8}{'in-flight':>10}{'act peak MiB':>13}{'per-mb MiB':>11}{'x per-mb':>9}{'alloc peak MiB':>15}")
    peaks: dict[tuple[str, int, int], float] = {}
    in_flight: dict[tuple[str, int, int], int] = {}
    stretches: dict[tuple[str, int], float] = {}
    for index, first in enumerate(per_rank[0]):
        schedule, m = first["schedule"], first["micro_batches"]
        rows = [rank_results[index] for rank_results in per_rank]
        bubbles = mean_bubbles([r["timelines"] for r in rows])
        replayed, stretches[(schedule, m)] = replay_bubbles(schedule, [r["timelines"] for r in rows])
        theory = theory_bubble(m, args.stages)
        for r, bubble, replay in zip(rows, bubbles, replayed):
            ratio = r["saved_peak"] / r["per_micro_batch"]
            peaks[(schedule, m, r["stage"])] = r["saved_peak"]
            in_flight[(schedule, m, r["stage"])] = r["in_flight"]
            print(f"{schedule:<9}{m:>3}{r['stage']:>6}{1e3 * _mean_duration(r['timelines'], 'forward'):>8.1f}"
                  f"{1e3 * _mean_duration(r['timelines'], 'backward'):>8.1f}{bubble:>8.3f}{theory:>8.3f}"
                  f"{bubble / theory:>8.2f}{replay:>8.3f}{r['in_flight']:>10}{_mib(r['saved_peak']):>13.2f}"
                  f"{_mib(r['per_micro_batch']):>11.2f}{ratio:>9.2f}{_mib(r['alloc_peak']):>15.2f}")
            if abs(ratio - r["in_flight"]) > MEMORY_TOLERANCE * r["in_flight"]:
                failures.append(f"{schedule} M={m} stage {r['stage']}: activation peak is {ratio:.3f} micro-batches, "
                                f"the schedule holds {r['in_flight']} in flight")
    print("\nbubble = 1 - stage compute / batch span (earliest start to latest end over all stages), mean over "
          "timed batches; theory (P-1)/(M+P-1). Not in the theory: p2p transfer time and the data reads (counted "
          "as idle), the loss on the last stage (unequal stages); the loss broadcast, gradient sync and optimizer "
          "step come after the span.")
    print("replay = the bubble if each action took its measured time and communication took none (the schedule "
          "replayed with zero-cost transfers): replay - theory is the cost of unequal / varying compute, "
          "bubble - replay the cost of communication and per-action overheads. Measured span / replayed span: "
          + ", ".join(f"{sched} M={m} {stretch:.3f}" for (sched, m), stretch in stretches.items()) + ".")
    print("act peak = distinct non-parameter bytes saved for backward held at once; per-mb = one micro-batch's; "
          "alloc peak = all tensor bytes train_batch allocated at once (also backward temporaries, received buffers).")
    print("\nactivation peak, GPipe / 1F1B (same M, same stage):")
    for m in args.micro_batches:
        ratios = [f"stage {s}: {peaks[('gpipe', m, s)] / peaks[('1f1b', m, s)]:.2f} "
                  f"(theory {in_flight[('gpipe', m, s)] / in_flight[('1f1b', m, s)]:.2f})" for s in range(args.stages)]
        print(f"  M={m}: " + ", ".join(ratios))
    print("  theory: GPipe holds M micro-batches, 1F1B P - s on stage s (at most P)")
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=128, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=8, help="residual blocks, split evenly over the stages")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages = spawned ranks")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8],
                        help="values of M = gradient_accumulation_steps")
    parser.add_argument("--steps", type=int, default=5, help="timed batches per (schedule, M)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per (schedule, M) before the timed ones")
    args = parser.parse_args(argv)
    for name in ("width", "rows", "layers", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.stages < 2:
        parser.error(f"--stages must be >= 2 (a pipeline), got {args.stages}")
    if args.layers % args.stages:
        parser.error(f"--layers {args.layers} must be divisible by --stages {args.stages} (equal stages)")
    too_few = [m for m in args.micro_batches if m < args.stages]
    if too_few:
        parser.error(f"--micro-batches {too_few} < --stages {args.stages}: 1F1B needs M >= P")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    failures = report(run_ranks(args), args)
    for failure in failures:
        print(f"FAIL: {failure}")
    print("\nevery activation peak = in-flight x per-micro-batch" if not failures else f"\n{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
