"""Tensor parallelism (AutoTP) and Ulysses sequence parallelism: per-rank memory and comm bytes vs Megatron.

    python benchmarks/bench_tp_sp.py                       # defaults below, 2 gloo ranks on CPU
    python benchmarks/bench_tp_sp.py --layers 1 --width 32 --heads 2 --vocab 64 --seq 32 --steps 1 --warmup 0

Workload: random-init GPT-2 (4 layers, width 256, 8 heads, vocab 8192, n_positions 1024, dropout 0,
sdpa attention), fp32, micro-batch 2 x sequence 1024, one thread per rank. A step is forward +
backward of one micro-batch (no optimizer, no data-parallel gradient sync: the engine is not used,
so every byte counted is tensor- or sequence-parallel traffic). Every rank builds the model with
the same seed and gets the same full batch.

Variants:

- ``1 rank``: the plain model in this process -- the baseline of both TP and SP.
- ``tp2``: 2 ranks, ``apply_autotp`` (vocab-parallel wte and tied LM head with the vocab-parallel
  loss, column-parallel c_attn / c_fc, row-parallel c_proj).
- ``sp2``: 2 ranks, ``install_ulysses_attention``; each rank cuts its 512 tokens out of the full
  batch with ``shard_sequence_batch``, and the loss is ``combine_sequence_parallel_loss``'s.

Measures, per rank:

- **parameters**: bytes of the distinct parameter storages. Theory for TP 2: AutoTP splits every
  parameter but the LayerNorms, wpe and the row-parallel biases, so the ratio is
  (replicated + split / 2) / total. SP replicates the model (ratio 1).
- **saved for backward**: bytes of the distinct non-parameter storages autograd keeps between
  forward and backward (a ``saved_tensors_hooks`` pack hook around the forward, as in
  bench_activation_checkpointing.py).
- **peak in step**: the most tensor bytes allocated at once during forward + backward
  (``tests/memory_probe.PeakTensorBytes``); it also counts the gradients.
- **comm bytes** of one step (``zerotune.distributed.comm`` counters, reset right before the
  forward, read after the backward; an all-reduce of S bytes counts 2S, an all-to-all the bytes
  each rank sends) against the formulas, with b = batch, s = sequence, h = width, L = layers,
  P = 2, 4-byte floats:

  * Megatron TP, all-reduce: per layer 2 of b*s*h in forward (attention and MLP row-parallel
    outputs) and 2 in backward (the column-parallel inputs' gradients); the vocab-parallel
    embedding's forward and the LM head's backward (b*s*h each); the vocab-parallel
    cross-entropy's row max (b*s) and fused [target logit, sum exp] (2*b*s). Calls 4L + 4,
    bytes 2 * 4 * (2 (2L + 1) b s h + 3 b s).
  * Ulysses, all-to-all: per layer q, k, v and the output in forward, their gradients in
    backward, each b*(s/P)*h elements sent per rank: calls 8L, bytes 8L * 4 b (s/P) h; plus the
    loss combine's all-reduce of one float (8 bytes).

- **step time**: median over ``--steps`` timed steps after ``--warmup`` (a 2-rank step is the
  slower rank's); informational -- on 2 shared CPU cores the 2-rank variants use both cores.

Exits nonzero if a measured comm volume (bytes or calls, any rank) differs from its formula, or
a variant's loss differs from the 1-rank loss by more than 1e-4 relative.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_dp_vs_ddp import _free_port, _storage_bytes, spawn_ranks, write_gathered

from tests.memory_probe import PeakTensorBytes, saved_for_backward

FLOAT_BYTES = 4
PARALLEL = 2  # ranks of the tp2 / sp2 variants
VARIANTS = ("tp2", "sp2")
LOSS_TOLERANCE = 1e-4


# ----------------------------------------------------------------------------- workload


def new_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random-init GPT-2 of the workload; the same weights on every call (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=max(1024, args.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(config).train()


def full_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def prepare(variant: str, model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    if variant == "tp2":
        from zerotune.parallel.tensor.autotp import apply_autotp

        apply_autotp(model, group)
    elif variant == "sp2":
        from zerotune.parallel.sequence import install_ulysses_attention

        install_ulysses_attention(model, group)


def forward_loss(variant: str, model: torch.nn.Module, batch: dict, group: dist.ProcessGroup | None) -> torch.Tensor:
    if variant != "sp2":
        return model(**batch).loss
    from zerotune.parallel.sequence import (
        combine_sequence_parallel_loss,
        shard_sequence_batch,
    )

    return combine_sequence_parallel_loss(model(**shard_sequence_batch(batch, group, model)).loss, group)


# ----------------------------------------------------------------------------- measures of one variant


def _saved_and_comm(variant: str, model: torch.nn.Module, batch: dict, group) -> tuple[int, dict, float]:
    """One step: distinct non-parameter storages saved for backward, comm counters, the loss."""
    from zerotune.distributed import comm

    model.zero_grad(set_to_none=True)
    comm.reset_comm_stats()
    with saved_for_backward(model.parameters()) as storages:
        loss = forward_loss(variant, model, batch, group)
    loss.backward()
    ops = {op: [s.calls, s.bytes] for op, s in comm.comm_stats().items() if s.calls}
    return sum(storages.values()), ops, loss.item()


def _step(variant: str, model: torch.nn.Module, batch: dict, group) -> None:
    model.zero_grad(set_to_none=True)
    forward_loss(variant, model, batch, group).backward()


def measure(variant: str, args: argparse.Namespace, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Everything the table shows for ``variant`` on this rank (a fresh model, then memory, comm, time)."""
    model, batch = new_model(args), full_batch(args)
    prepare(variant, model, group)
    result: dict[str, Any] = {"param_bytes": _storage_bytes(model.parameters())}
    result["saved_bytes"], result["comm_ops"], result["loss"] = _saved_and_comm(variant, model, batch, group)
    with PeakTensorBytes() as probe:
        _step(variant, model, batch, group)
    result["peak_bytes"] = probe.peak
    times = []
    for index in range(args.warmup + args.steps):
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        _step(variant, model, batch, group)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    result["times"] = times
    return result


def _rank_main(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=PARALLEL)
    try:
        group = dist.new_group(list(range(PARALLEL)))
        results = {variant: measure(variant, args, group) for variant in VARIANTS}
        write_gathered(results, out_dir)
    finally:
        dist.destroy_process_group()


def run_parallel_variants(args: argparse.Namespace) -> list[dict]:
    """Per-rank results of tp2 and sp2, measured in ``PARALLEL`` spawned gloo ranks."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (_free_port(), args, out_dir), PARALLEL)
        with open(os.path.join(out_dir, "result.json")) as handle:
            return json.load(handle)


# ----------------------------------------------------------------------------- theory


def tp_parameter_ratio(args: argparse.Namespace, tp: int = PARALLEL) -> tuple[float, int]:
    """Per-rank parameters / all parameters under AutoTP, and the total element count.

    Split: wte (tied LM head), c_attn and c_fc (weight + bias), both c_proj weights. Replicated:
    wpe, the LayerNorms (ln_1, ln_2, ln_f) and the row-parallel c_proj biases."""
    h, layers = args.width, args.layers
    split_per_layer = (h * 3 * h + 3 * h) + h * h + (h * 4 * h + 4 * h) + 4 * h * h
    replicated_per_layer = 2 * 2 * h + h + h
    split = args.vocab * h + layers * split_per_layer
    replicated = max(1024, args.seq) * h + layers * replicated_per_layer + 2 * h
    total = split + replicated
    return (replicated + split / tp) / total, total


def comm_formulas(args: argparse.Namespace, size: int = PARALLEL) -> dict[str, dict[str, tuple[int, int]]]:
    """{variant: {op: (calls, bytes)}} of one forward + backward, in comm.py's counting."""
    b, s, h, layers = args.batch, args.seq, args.width, args.layers
    activation = b * s * h * FLOAT_BYTES
    tp_calls = (2 * layers + 1) * 2 + 2  # forward + backward activation all-reduces, 2 in the loss
    tp_bytes = 2 * (2 * (2 * layers + 1) * activation + 3 * b * s * FLOAT_BYTES)
    sp_bytes = 8 * layers * b * (s // size) * h * FLOAT_BYTES
    return {"tp2": {"all_reduce": (tp_calls, tp_bytes)},
            "sp2": {"all_to_all": (8 * layers, sp_bytes), "all_reduce": (1, 2 * FLOAT_BYTES)}}


# ----------------------------------------------------------------------------- report


def _mib(n: float) -> float:
    return n / 2**20


def report(baseline: dict, per_rank: list[dict], args: argparse.Namespace) -> list[str]:
    """Print the tables; return the list of failures (comm vs formula, loss vs 1 rank)."""
    failures: list[str] = []
    ratio_theory, psi = tp_parameter_ratio(args)
    print(f"GPT-2 (layers {args.layers}, width {args.width}, heads {args.heads}, vocab {args.vocab}, "
          f"{psi / 1e6:.2f}M params), fp32, sdpa, micro-batch {args.batch} x seq {args.seq}, 1 thread per rank, "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    rows = {"1 rank": [baseline]} | {v: [r[v] for r in per_rank] for v in VARIANTS}
    print(f"\n{'variant':<9}{'rank':>5}{'params MiB':>12}{'x 1 rank':>10}{'saved bwd MiB':>15}{'x 1 rank':>10}"
          f"{'peak MiB':>10}{'x 1 rank':>10}{'step s':>9}{'loss':>11}")
    for variant, ranks in rows.items():
        for rank, r in enumerate(ranks):
            print(f"{variant:<9}{rank:>5}{_mib(r['param_bytes']):>12.2f}{r['param_bytes'] / baseline['param_bytes']:>10.3f}"
                  f"{_mib(r['saved_bytes']):>15.1f}{r['saved_bytes'] / baseline['saved_bytes']:>10.3f}"
                  f"{_mib(r['peak_bytes']):>10.1f}{r['peak_bytes'] / baseline['peak_bytes']:>10.3f}"
                  f"{_step_time(ranks, rank):>9.3f}{r['loss']:>11.6f}")
            if abs(r["loss"] - baseline["loss"]) > LOSS_TOLERANCE * abs(baseline["loss"]):
                failures.append(f"{variant} rank {rank}: loss {r['loss']!r} != 1-rank loss {baseline['loss']!r}")
    tp_measured = max(r["tp2"]["param_bytes"] for r in per_rank) / baseline["param_bytes"]
    print(f"\nTP 2 parameters per rank: measured {tp_measured:.3f} x 1 rank, theory {ratio_theory:.3f} "
          "(all split but LayerNorms, wpe and row-parallel biases); SP 2 theory 1.000")
    time_tp = statistics.median(max(ts) for ts in zip(*[r["tp2"]["times"] for r in per_rank]))
    time_sp = statistics.median(max(ts) for ts in zip(*[r["sp2"]["times"] for r in per_rank]))
    time_1 = statistics.median(baseline["times"])
    print(f"step time (median; 2-rank steps: slower rank): 1 rank {time_1:.3f} s, tp2 {time_tp:.3f} s "
          f"({time_tp / time_1:.2f}x), sp2 {time_sp:.3f} s ({time_sp / time_1:.2f}x)")

    formulas = comm_formulas(args)
    print(f"\ncomm per step (forward + backward, per rank){'':<3}{'calls':>7}{'formula':>9}{'bytes':>12}"
          f"{'formula bytes':>15}{'measured/formula':>18}")
    for variant in VARIANTS:
        for rank, r in enumerate(per_rank):
            measured = r[variant]["comm_ops"]
            for op in sorted(set(measured) | set(formulas[variant])):
                calls, nbytes = measured.get(op, (0, 0))
                want_calls, want_bytes = formulas[variant].get(op, (0, 0))
                ratio = nbytes / want_bytes if want_bytes else float("inf") if nbytes else 1.0
                print(f"  {variant} rank {rank} {op:<28}{calls:>7}{want_calls:>9}{nbytes:>12}"
                      f"{want_bytes:>15}{ratio:>18.3f}")
                if (calls, nbytes) != (want_calls, want_bytes):
                    failures.append(f"{variant} rank {rank} {op}: measured {calls} calls / {nbytes} B, formula "
                                    f"{want_calls} calls / {want_bytes} B")
    print("  formulas: TP all_reduce 2*4*(2(2L+1) b s h + 3 b s) B in 4L+4 calls; SP all_to_all 8L * 4 b (s/P) h B, "
          "all_reduce 8 B (loss)")
    print(f"\n1-rank comm (should be none): {baseline['comm_ops'] or 'none'}")
    if baseline["comm_ops"]:
        failures.append(f"1 rank communicated: {baseline['comm_ops']}")
    return failures


def _step_time(ranks: list[dict], rank: int) -> float:
    return statistics.median(ranks[rank]["times"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch (rows), the same full batch on every rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant before the timed ones")
    args = parser.parse_args(argv)
    for name in ("layers", "width", "heads", "vocab", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    for name in ("heads", "vocab", "seq"):
        if getattr(args, name) % PARALLEL:
            parser.error(f"--{name} {getattr(args, name)} must be divisible by {PARALLEL} (the tp / sp size)")
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be divisible by --heads {args.heads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name, value in {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(name, value)  # inherited by the spawned ranks
    torch.set_num_threads(1)
    baseline = measure("1 rank", args, None)
    failures = report(baseline, run_parallel_variants(args), args)
    for failure in failures:
        print(f"FAIL: {failure}")
    print("\nall comm volumes match their formulas" if not failures else f"\n{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
