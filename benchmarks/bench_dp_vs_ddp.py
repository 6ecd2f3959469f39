"""zerotune's stage-0 engine vs torch DistributedDataParallel, same model and data, one run.

    python benchmarks/bench_dp_vs_ddp.py            # 2 gloo ranks on CPU (CUDA/NCCL when present)
    python benchmarks/bench_dp_vs_ddp.py --world 1  # single-device mode (e.g. one GPU)

Workload (as in shared/REFERENCE.md): random-init GPT-2, 4 layers, width 256, vocab 8192,
sequence 128, micro-batch 4 per rank, AdamW, fp32, no clipping, one thread per rank. Each
method runs in fresh processes (the RSS high-water mark survives fork), alternating
DDP / zerotune over several rounds because this machine is noisy; the printed ratio is the
median of the per-round ratios. Step time is the slowest rank's median step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
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


def _rank_main(rank: int, method: str, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerotune

    env = zerotune.init_distributed()
    device = env.device
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL, n_ctx=args.seq, bos_token_id=0, eos_token_id=0)).to(device)
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train_step(step: int) -> None:
            wrapped(**_batch(step, rank, args.micro, args.seq, device)).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def state_tensors():
            states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            # DDP's own bucket copy of the gradients (another 4 bytes/param) has no public handle: not counted.
            return list(model.parameters()) + [p.grad for p in model.parameters()] + states
    else:
        config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": 0, "reduce_bucket_size": int(args.bucket_mb * 2**20 / 4)}}
        engine, optimizer, _, _ = zerotune.initialize(model=model, model_parameters=model.parameters(),
                                                      config=config)

        def train_step(step: int) -> None:
            loss = engine(**_batch(step, rank, args.micro, args.seq, device)).loss
            engine.backward(loss)
            engine.step()

        def state_tensors():
            states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            buckets = [b.buffer for b in engine.grad_sync.buckets.buckets]
            return list(model.parameters()) + buckets + states

    for step in range(args.warmup):
        train_step(step)
    _reset_peak_rss()
    times = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        train_step(args.warmup + step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {"median_s": statistics.median(times), "peak_rss_mib": _peak_rss_mib(),
              "model_state_mib": _storage_bytes(state_tensors()) / 2**20,
              "params": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        result["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(os.path.join(out_dir, f"{method}.json"), "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def run_method(method: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(method, args.world, _free_port(), args, out_dir), nprocs=args.world,
                           start_method="spawn", join=True)
        with open(os.path.join(out_dir, f"{method}.json")) as handle:
            return json.load(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb; same bytes for zerotune")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # RSS then tracks live memory (REFERENCE.md)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    ratios, rows = [], {"ddp": [], "zerotune": []}
    for round_index in range(args.rounds):
        for method in ("ddp", "zerotune"):
            rows[method].append(run_method(method, args))
        step = {m: max(r["median_s"] for r in rows[m][-1]) for m in rows}
        ratios.append(step["zerotune"] / step["ddp"])
        print(f"round {round_index + 1}: DDP {step['ddp'] * 1e3:.1f} ms/step, zerotune {step['zerotune'] * 1e3:.1f} "
              f"ms/step, ratio {ratios[-1]:.3f}", flush=True)

    tokens_per_step = args.micro * args.seq * args.world
    print(f"\nGPT-2 {MODEL} ({rows['ddp'][0][0]['params'] / 1e6:.2f}M params), {args.world} rank(s), "
          f"micro-batch {args.micro} x seq {args.seq}, AdamW fp32")
    print(f"{'method':<10} {'ms/step':>9} {'tokens/s':>10} {'peak RSS MiB/rank':>18} {'model state MiB/rank':>21}")
    for method in ("ddp", "zerotune"):
        step_s = statistics.median(max(r["median_s"] for r in run) for run in rows[method])
        rss = statistics.median(max(r["peak_rss_mib"] for r in run) for run in rows[method])
        state = rows[method][0][0]["model_state_mib"]
        print(f"{method:<10} {step_s * 1e3:>9.1f} {tokens_per_step / step_s:>10.0f} {rss:>18.0f} {state:>21.1f}")
    print(f"\nstep-time ratio zerotune / DDP (median of {args.rounds} rounds): {statistics.median(ratios):.3f} "
          f"(target <= 1.00)")


if __name__ == "__main__":
    main()
