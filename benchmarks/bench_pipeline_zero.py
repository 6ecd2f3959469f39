"""Pipeline x ZeRO: per-rank model state and communication per step, ZeRO 0 / 1 / 2 over each stage's
data-parallel ranks.

    python benchmarks/bench_pipeline_zero.py                  # pp 2 x dp 2 on 4 gloo ranks
    python benchmarks/bench_pipeline_zero.py --stages 4 --dp 2 # pp 4 x dp 2 on 8 ranks (the seed's 2D layout)

Workload: a ``PipelineModule`` of ``--layers`` residual blocks ``x + tanh(Linear(x))`` (width ``--width``)
split evenly over ``--stages``, fp32, Adam, ``--micro-batches`` micro-batches of ``--rows`` rows per
``train_batch`` (1F1B). For each ZeRO stage: one warm-up batch, then one measured batch. Per rank:
``engine.memory_breakdown()`` (parameters, gradients, optimizer state, communication buffers) after
the batch, and the bytes its collectives moved during the batch (``zerotune.comm.comm_stats``).

Theory, for the Psi_s parameters of a stage (fp32 + Adam; bytes): ZeRO-0 4 params + 4 grads + 8 Adam;
ZeRO-1 4 + 4 + 8/dp; ZeRO-2 4 + (4 + 8)/dp (+ its reduce buckets, reported apart). Communication:
ZeRO 0-2 all move 2 x 4 x Psi_s per step over dp (ZeRO-2 reduces every micro-batch to the owners:
micro-batches x 4 x Psi_s, plus the 4 x Psi_s all-gather), and pipelines add the p2p activations.
Exits nonzero if a measured state differs from its theory by more than 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp_vs_ddp import _free_port, spawn_ranks, write_gathered  # noqa: E402
from bench_pipeline import ResidualBlock, _mse  # noqa: E402  (the same residual-block workload)

ZERO_STAGES = (0, 1, 2)


def measure(args: argparse.Namespace, zero_stage: int) -> dict:
    import zerotune
    from zerotune.pipe import LayerSpec, PipelineModule

    pipe = PipelineModule([LayerSpec(ResidualBlock, args.width) for _ in range(args.layers)], num_stages=args.stages,
                          loss_fn=_mse, seed_layers=True, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": args.rows, "gradient_accumulation_steps": args.micro_batches,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
              "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": args.bucket}}
    engine, *_ = zerotune.initialize(model=pipe, config=config)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.rows, args.width, generator=generator),
                torch.randn(args.rows, args.width, generator=generator)) for _ in range(args.micro_batches)]
    engine.train_batch(iter(batches))  # warm-up: optimizer state exists from here on
    zerotune.comm.reset_comm_stats()
    engine.train_batch(iter(batches))
    stats = zerotune.comm.comm_stats()
    result = {"zero": zero_stage, "stage": engine.mpu.get_pipe_parallel_rank(),
              "psi": sum(p.numel() for p in engine.module.parameters()), **engine.memory_breakdown(),
              "dp_bytes": sum(s.bytes for op, s in stats.items() if op != "send"),
              "p2p_bytes": stats["send"].bytes if "send" in stats else 0}
    engine.destroy()
    return result


def _rank_main(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    world = args.stages * args.dp
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import zerotune

    zerotune.init_distributed()
    try:
        results = [measure(args, zero) for zero in ZERO_STAGES]
        write_gathered(results, out_dir)
    finally:
        dist.destroy_process_group()


def theory_state(zero: int, psi: int, dp: int) -> dict[str, float]:
    """fp32 + Adam bytes of one rank holding Psi parameters: params, grads, optimizer state."""
    return {"params": 4 * psi, "grads": 4 * psi if zero < 2 else 4 * psi / dp,
            "optimizer_state": 8 * psi if zero == 0 else 8 * psi / dp}


def report(per_rank: list[list[dict]], args: argparse.Namespace) -> tuple[list[str], bool]:
    mib = 2**20
    lines = [f"pipeline x ZeRO: pp {args.stages} x dp {args.dp}, {args.layers} blocks of width {args.width}, "
             f"{args.micro_batches} micro-batches of {args.rows} rows, fp32 + Adam; per rank (first dp rank of "
             "each stage), MiB",
             "| pp stage | ZeRO | params | grads | optimizer state | model state | x theory | x ZeRO-1 | "
             "dp comm / step | p2p / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for stage in range(args.stages):
        rows = {r["zero"]: r for ranks in per_rank for r in ranks if r["stage"] == stage}
        zero1_state = sum(rows[1][k] for k in ("params", "grads", "optimizer_state"))
        for zero in ZERO_STAGES:
            row = rows[zero]
            state = sum(row[k] for k in ("params", "grads", "optimizer_state"))
            theory = sum(theory_state(zero, row["psi"], args.dp).values())
            ok &= abs(state / theory - 1) <= 0.01
            lines.append(f"| {stage} | {zero} | {row['params'] / mib:.2f} | {row['grads'] / mib:.2f} | "
                         f"{row['optimizer_state'] / mib:.2f} | {state / mib:.2f} | {state / theory:.3f} | "
                         f"{state / zero1_state:.3f} | {row['dp_bytes'] / mib:.2f} | {row['p2p_bytes'] / mib:.2f} |")
    lines.append("every model state matches its theory (within 1%)" if ok else "MODEL STATE DIFFERS FROM THEORY")
    return lines, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=2**20, help="reduce_bucket_size (elements)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (_free_port(), args, out_dir), args.stages * args.dp)
        with open(os.path.join(out_dir, "result.json")) as handle:
            per_rank = json.load(handle)
    lines, ok = report(per_rank, args)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
