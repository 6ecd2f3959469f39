"""zerotune's stage-0 engine vs torch DistributedDataParallel, same model and data, one run.

    python benchmarks/bench_dp_vs_ddp.py            # 2 gloo ranks on CPU (CUDA/NCCL when present)
    python benchmarks/bench_dp_vs_ddp.py --world 1  # single-device mode (e.g. one GPU)

Workload: random-init GPT-2, 4 layers, width 256, vocab 8192,
sequence 128, micro-batch 4 per rank, AdamW, fp32, no clipping, one thread per rank.

Timing: both methods live in the same rank processes and their steps are interleaved
(DDP, zerotune, zerotune, DDP, ...), so the machine's noise -- large on 2 shared cores -- hits
both alike; a step's time is the slowest rank's, and the ratio compares the medians.
Memory: each method then runs alone in fresh processes (the RSS high-water mark survives
fork), for its peak RSS; "model state" counts tensor storages (params, grads, optimizer
state, communication buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_main, args: tuple, nprocs: int) -> None:
    """Run ``rank_main(rank, *args)`` in ``nprocs`` spawned processes and wait for all of them.

    A rank whose ``rank_main`` returns (its results written, its process group destroyed) ends with
    ``os._exit(0)`` rather than the interpreter's full teardown. Destroying a gloo group does not
    always stop its threads at once, and a process that exits with native threads running can
    abort in the static destructors: CI saw a rank of bench_pipeline die with SIGABRT, "terminate
    called without an active exception", after its work was done. A rank that raises still exits 1
    with its traceback.
    """
    mp.start_processes(_run_rank, args=(rank_main, *args), nprocs=nprocs, start_method="spawn", join=True)


def write_gathered(results: object, out_dir: str) -> None:
    """Gather every rank's ``results`` (rank order) and have rank 0 write them to ``out_dir/result.json``,
    which the parent reads once ``spawn_ranks`` returns."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as handle:
            json.dump(gathered, handle)


def _run_rank(rank: int, rank_main, *args: object) -> None:
    rank_main(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _batch(step: int, rank: int, micro: int, seq: int, device) -> dict:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    ids = torch.randint(0, MODEL["vocab_size"], (micro, seq), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def _build(method: str, rank: int, args: argparse.Namespace, device: torch.device):
    """A fresh model (same init for both methods) wrapped by ``method``; returns (train_step, state tensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerotune

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL, n_ctx=args.seq, bos_token_id=0, eos_token_id=0)).to(device)
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # gradient_as_bucket_view: DDP's gradients *are* its buckets (its leanest, usually fastest
        # setting), so counting the gradients counts everything DDP holds.
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        last_grads: list = []

        def train_step(step: int) -> None:
            wrapped(**_batch(step, rank, args.micro, args.seq, device)).loss.backward()
            optimizer.step()
            # Keep a reference to the bucket views so the (persistent) buckets are counted.
            last_grads[:] = [p.grad for p in model.parameters()]
            optimizer.zero_grad(set_to_none=True)

        def state_tensors():
            states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            return list(model.parameters()) + last_grads + states
        return train_step, state_tensors, model

    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0, "reduce_bucket_size": int(args.bucket_mb * 2**20 / 4)}}
    engine, optimizer, _, _ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)

    def train_step(step: int) -> None:
        loss = engine(**_batch(step, rank, args.micro, args.seq, device)).loss
        engine.backward(loss)
        engine.step()

    def state_tensors():
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return list(model.parameters()) + [b.buffer for b in engine.state._grad_sync.buckets.buckets] + states
    return train_step, state_tensors, model


def _timed(train_step, step: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    train_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rank_main(rank: int, phase: str, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    """phase "time": both methods in the same processes, steps interleaved, so machine noise hits both alike;
    phase "memory:<method>": one method alone in fresh processes, for its peak RSS."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    import zerotune

    device = zerotune.init_distributed().device
    methods = ("ddp", "zerotune") if phase == "time" else (phase.split(":")[1],)
    built = {m: _build(m, rank, args, device) for m in methods}
    for step in range(args.warmup):
        for method in methods:
            built[method][0](step)
    _reset_peak_rss()
    times = {m: [] for m in methods}
    steps = args.steps if phase == "time" else 3
    for step in range(steps):
        for method in (methods if step % 2 == 0 else methods[::-1]):
            times[method].append(_timed(built[method][0], args.warmup + step, device))
    result = {m: {"times": times[m], "model_state_mib": _storage_bytes(built[m][1]()) / 2**20,
                  "params": sum(p.numel() for p in built[m][2].parameters())} for m in methods}
    if phase != "time":
        result[methods[0]]["peak_rss_mib"] = _peak_rss_mib()
        if device.type == "cuda":
            result[methods[0]]["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    write_gathered(result, out_dir)
    dist.destroy_process_group()


def run_phase(phase: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (phase, args.world, _free_port(), args, out_dir), args.world)
        with open(os.path.join(out_dir, "result.json")) as handle:
            return json.load(handle)


def add_workload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The workload knobs every benchmark of this family shares (the module docstring's GPT-2 workload by default)."""
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDP's bucket_cap_mb; the same bytes for zerotune's all-reduce buckets")
    return parser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_workload_arguments(parser).parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # RSS then tracks live memory (freed blocks go back to the OS)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    per_rank = run_phase("time", args)
    # The slowest rank sets each step's time; compare medians of interleaved steps.
    step_s = {m: statistics.median(max(rank[m]["times"][i] for rank in per_rank) for i in range(args.steps))
              for m in ("ddp", "zerotune")}
    memory = {m: run_phase(f"memory:{m}", args) for m in ("ddp", "zerotune")}

    tokens_per_step = args.micro * args.seq * args.world
    print(f"GPT-2 {MODEL} ({per_rank[0]['ddp']['params'] / 1e6:.2f}M params), {args.world} rank(s), "
          f"micro-batch {args.micro} x seq {args.seq}, AdamW fp32, {args.steps} interleaved steps per method")
    print(f"{'method':<10} {'ms/step':>9} {'tokens/s':>10} {'peak RSS MiB/rank':>18} {'model state MiB/rank':>21}")
    for method in ("ddp", "zerotune"):
        rss = max(rank[method]["peak_rss_mib"] for rank in memory[method])
        state = per_rank[0][method]["model_state_mib"]
        print(f"{method:<10} {step_s[method] * 1e3:>9.1f} {tokens_per_step / step_s[method]:>10.0f} {rss:>18.0f} "
              f"{state:>21.1f}")
    print(f"\nstep-time ratio zerotune / DDP: {step_s['zerotune'] / step_s['ddp']:.3f} (target <= 1.00)")

if __name__ == "__main__":
    main()
