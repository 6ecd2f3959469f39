"""Top-K gradient compression against dense gradients: bytes on the wire, step time, final eval loss.

    python benchmarks/bench_compression.py               # ZeRO stage 0, 2 gloo ranks, ~5 min on 2 CPU cores
    python benchmarks/bench_compression.py --stage 2     # the same through stage 2's bucketed reduce
    python benchmarks/bench_compression.py --steps 20 --eval-every 10 --width 32 --layers 1   # smoke test

Runs: dense (no ``gradient_compression`` block), Top-K ratio 0.1 and 0.01 with error feedback,
and 0.01 without it -- every run from the same initial weights on the same batches.

Workload, and why not the bundled ``zerotune finetune`` recipe: one default run of that recipe
takes ~2.2 min on 2 CPU ranks here, so four runs plus a separate in-process counter measurement
do not fit in ~10 minutes, and its metric after 80 steps (accuracy on 1000 snippets, the loss
still mid-descent) says little about where a slower-converging run ends up.
Instead: a random-init GPT-2 (2 layers, width 64) learns an order-2 Markov language over 16
tokens with a fixed seed -- the next token is ``table[previous two tokens]`` with probability
1 - noise, else uniform -- which needs
attention to the two previous positions and has a known floor (the chain's entropy). The eval
metric is the cross-entropy on a held-out split (positions whose two predecessors are known),
with token accuracy alongside; training stops after the same number of steps for every run.
Top-K 0.01 converges a few times slower in steps (at 1000 steps it was still 9.5% above dense),
so the default 2000 steps let it arrive; AdamW, as fine-tuning would use (``--optimizer sgd``).

Measurement: all runs live in the same rank processes and their steps are interleaved in a
rotating order, so the machine's noise hits all alike (as bench_zero12.py); a step's time is the
slowest rank's, and the table shows medians. Gradient bytes per step are read from
``zerotune.comm.comm_stats()`` around each step, summed over the gradient-reduction ops
(``compression.GRADIENT_OPS``: all_reduce, reduce_scatter, reduce, sparse_all_gather) and averaged
over all steps of the run (compression warm-up steps included); stage 1/2's parameter all-gather
is not gradient traffic and is shown apart. The sparse exchange counts what it gathers (16 k bytes
for k int32 + fp32 pairs from 2 ranks); the dense baseline follows the ZeRO-paper convention (an
all-reduce counts 2 x 4 n, stage 1/2's reduce-scatter / reduce 4 n), so ratio r shows as 2r at
stage 0 and 4r at stages 1 and 2. The engine's own count of sent vs dense gradient
bytes (``engine.compressor.stats``) is printed as a cross-check.

Acceptance (exit status 1 when missed): Top-K 0.01 with error feedback moves <= 10% of the dense
run's gradient bytes per step and its final eval loss is within 2% (relative) of the dense run's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp_vs_ddp import _free_port, spawn_ranks, write_gathered

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "compression_loss.png")
TARGET_BYTES_FRACTION = 0.10  # ratio 0.01 + EF must move <= 10% of dense gradient bytes per step
TARGET_EVAL_GAP = 0.02  # ... and end within 2% (relative) of the dense run's eval loss
ACCEPTANCE_RUN = "topk 0.01 +EF"


@dataclass(frozen=True)
class Run:
    """One training run: its name and its ``gradient_compression`` block (None: dense)."""

    name: str
    ratio: float | None
    error_feedback: bool = True

    def compression_block(self, warmup_steps: int) -> dict | None:
        if self.ratio is None:
            return None
        return {"method": "topk", "ratio": self.ratio, "error_feedback": self.error_feedback,
                "warmup_steps": warmup_steps, "min_bucket_numel": 0}


RUNS = (Run("dense", None), Run("topk 0.1 +EF", 0.1), Run(ACCEPTANCE_RUN, 0.01),
        Run("topk 0.01 no EF", 0.01, error_feedback=False))


# ---- the synthetic language -------------------------------------------------------------------
def markov_table(vocab: int, order: int, seed: int) -> torch.Tensor:
    """The likely successor of every context of ``order`` tokens, flattened (index: the context read
    as a base-``vocab`` number, oldest token first); fixed by ``seed``."""
    return torch.randint(0, vocab, (vocab ** order,), generator=torch.Generator().manual_seed(seed))


def sample_sequences(table: torch.Tensor, vocab: int, order: int, count: int, seq: int, noise: float,
                     seed: int) -> torch.Tensor:
    """``count`` sequences of the chain: ``order`` uniform tokens, then table lookups replaced by a
    uniform token with probability ``noise``."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.empty(count, seq, dtype=torch.long)
    out[:, :order] = torch.randint(0, vocab, (count, order), generator=generator)
    for position in range(order, seq):
        context = torch.zeros(count, dtype=torch.long)
        for back in range(order, 0, -1):
            context = context * vocab + out[:, position - back]
        random_tokens = torch.randint(0, vocab, (count,), generator=generator)
        out[:, position] = torch.where(torch.rand(count, generator=generator) < noise, random_tokens, table[context])
    return out


def entropy_floor(vocab: int, noise: float) -> float:
    """The chain's per-token entropy in nats: the lowest eval loss any model can reach."""
    p_follow, p_other = 1 - noise + noise / vocab, noise / vocab
    return -sum(p * math.log(p) for p in (p_follow, *[p_other] * (vocab - 1)) if p > 0)


def _loss_and_hits(model: torch.nn.Module, ids: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy and correctness of the predictions of positions ``order``.. (the
    predictable ones: their whole context is in the sequence)."""
    logits = model(input_ids=ids).logits[:, order - 1:-1]
    targets = ids[:, order:]
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                               reduction="none")
    return losses, (logits.argmax(-1).reshape(-1) == targets.reshape(-1))


# ---- one rank ---------------------------------------------------------------------------------
def _new_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the same initial weights for every run
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq, n_ctx=args.seq, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _engine_config(run: Run, args: argparse.Namespace) -> dict:
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": args.stage},
              "optimizer": _optimizer_block(args),
              "scheduler": {"type": "WarmupDecayLR",
                            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                       "warmup_num_steps": max(1, args.steps // 20), "total_num_steps": args.steps}}}
    block = run.compression_block(args.compression_warmup)
    if block is not None:
        config["gradient_compression"] = block
    return config


def _optimizer_block(args: argparse.Namespace) -> dict:
    if args.optimizer == "sgd":
        return {"type": "SGD", "params": {"lr": args.lr, "momentum": args.momentum}}
    return {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}


def _evaluate(model: torch.nn.Module, eval_ids: torch.Tensor, order: int, rank: int, world: int
              ) -> tuple[float, float]:
    """(mean loss, accuracy) over the eval split, each rank scoring its share."""
    share = eval_ids[rank::world]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses, hits = _loss_and_hits(model, share, order)
    model.train(was_training)
    totals = torch.tensor([losses.sum().item(), hits.sum().item(), float(losses.numel())], dtype=torch.float64)
    dist.all_reduce(totals)  # outside the counted window: not part of any step's bytes
    return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()


def _gradient_bytes(stats: dict) -> tuple[int, int]:
    """(gradient-reduction bytes, other bytes) of one step's comm counters."""
    from zerotune.distributed.compression import GRADIENT_OPS

    gradient = sum(s.bytes for op, s in stats.items() if op in GRADIENT_OPS)
    return gradient, sum(s.bytes for s in stats.values()) - gradient


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    import zerotune
    from zerotune import comm

    device = zerotune.init_distributed().device
    table = markov_table(args.vocab, args.order, seed=1234)
    eval_ids = sample_sequences(table, args.vocab, args.order, args.eval_sequences, args.seq, args.noise,
                                seed=999_999).to(device)
    engines = {}
    for run in RUNS:
        model = _new_model(args).to(device)
        engines[run.name] = zerotune.initialize(model=model, model_parameters=model.parameters(),
                                                config=_engine_config(run, args))[0]
    record = {run.name: {"loss": [], "time": [], "grad_bytes": [], "other_bytes": [], "eval": []} for run in RUNS}
    names = [run.name for run in RUNS]
    for step in range(args.steps):
        ids = sample_sequences(table, args.vocab, args.order, args.micro, args.seq, args.noise,
                               seed=step * world + rank).to(device)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            engine, entry = engines[name], record[name]
            dist.barrier()
            comm.reset_comm_stats()
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            entry["time"].append(time.perf_counter() - start)
            gradient, other = _gradient_bytes(comm.comm_stats())
            entry["grad_bytes"].append(gradient)
            entry["other_bytes"].append(other)
            entry["loss"].append(loss.item())
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                entry["eval"].append((step + 1, *_evaluate(engine.module, eval_ids, args.order, rank, world)))
    for name, engine in engines.items():
        stats = engine.compressor.stats if engine.compressor is not None else None
        # steps_per_print is huge, so the engine never reset its stats: they cover the whole run
        record[name]["engine_sent_dense"] = [stats.sent_bytes, stats.dense_bytes] if stats else None
    write_gathered(record, out_dir)
    dist.destroy_process_group()


def run_ranks(args: argparse.Namespace) -> list[dict]:
    """Every run's per-rank record: losses, times, bytes per step, eval points."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (args.world, _free_port(), args, out_dir), args.world)
        with open(os.path.join(out_dir, "result.json")) as handle:
            return json.load(handle)


# ---- report -----------------------------------------------------------------------------------
@dataclass
class Result:
    """One run's figures across ranks."""

    grad_bytes: float  # mean per step, rank 0's counters (every rank moves the same volume)
    other_bytes: float
    step_s: float  # median over steps of the slowest rank's time
    train_loss: list[float]  # per step, mean over ranks
    eval_points: list[tuple[int, float, float]]  # (step, loss, accuracy)
    engine_sent_fraction: float | None

    @property
    def final_eval_loss(self) -> float:
        return self.eval_points[-1][1]


def summarize(per_rank: list[dict]) -> dict[str, Result]:
    results = {}
    for run in RUNS:
        records = [r[run.name] for r in per_rank]
        steps = len(records[0]["loss"])
        sent_dense = records[0]["engine_sent_dense"]
        results[run.name] = Result(
            grad_bytes=statistics.mean(records[0]["grad_bytes"]), other_bytes=statistics.mean(records[0]["other_bytes"]),
            step_s=statistics.median(max(r["time"][i] for r in records) for i in range(steps)),
            train_loss=[statistics.mean(r["loss"][i] for r in records) for i in range(steps)],
            eval_points=[tuple(p) for p in records[0]["eval"]],
            engine_sent_fraction=sent_dense[0] / sent_dense[1] if sent_dense and sent_dense[1] else None)
    return results


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict[str, Result], path: str, floor: float, title: str) -> None:
    """Training loss (moving average) and eval loss of every run, side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(figure)
    train_axes, eval_axes = figure.subplots(1, 2)
    window = max(1, len(next(iter(results.values())).train_loss) // 50)
    for name, result in results.items():
        train_axes.plot(range(1, len(result.train_loss) + 1), _smooth(result.train_loss, window), label=name)
        eval_axes.plot([p[0] for p in result.eval_points], [p[1] for p in result.eval_points], marker="o",
                       markersize=3, label=name)
    for axes, what in ((train_axes, f"training loss (moving average of {window} steps)"), (eval_axes, "eval loss")):
        axes.axhline(floor, color="grey", linestyle=":", label="entropy floor")
        axes.set_xlabel("optimizer step")
        axes.set_ylabel("cross-entropy (nats)")
        axes.set_title(what)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)


def report(results: dict[str, Result], args: argparse.Namespace) -> bool:
    """Print the table and the acceptance verdict; True when the 0.01 + EF run meets both targets."""
    dense = results["dense"]
    print(f"{'run':<17} {'grad KiB/step':>13} {'x dense':>8} {'other KiB/step':>14} {'engine sent':>11} "
          f"{'step ms':>8} {'x dense':>8} {'eval loss':>9} {'eval acc':>8} {'gap vs dense':>12}")
    for name, result in results.items():
        gap = (result.final_eval_loss - dense.final_eval_loss) / dense.final_eval_loss
        sent = f"{100 * result.engine_sent_fraction:.2f}%" if result.engine_sent_fraction is not None else "-"
        print(f"{name:<17} {result.grad_bytes / 1024:>13.1f} {result.grad_bytes / dense.grad_bytes:>8.4f} "
              f"{result.other_bytes / 1024:>14.1f} {sent:>11} {1000 * result.step_s:>8.1f} "
              f"{result.step_s / dense.step_s:>8.2f} {result.final_eval_loss:>9.4f} {result.eval_points[-1][2]:>8.4f} "
              f"{100 * gap:>+11.2f}%")
    print(f"(gradient bytes: comm counters of {', '.join(_gradient_ops())} per optimizer step, mean over the "
          f"{args.steps} steps, ZeRO paper convention; 'other' is stage 1/2's parameter all-gather; 'engine sent': "
          "engine.compressor.stats sent / dense gradient bytes; eval on "
          f"{args.eval_sequences} held-out sequences, entropy floor {entropy_floor(args.vocab, args.noise):.4f})")
    ef, no_ef = results[ACCEPTANCE_RUN], results["topk 0.01 no EF"]
    fraction = ef.grad_bytes / dense.grad_bytes
    gap = abs(ef.final_eval_loss - dense.final_eval_loss) / dense.final_eval_loss
    bytes_ok, eval_ok = fraction <= TARGET_BYTES_FRACTION, gap <= TARGET_EVAL_GAP
    print(f"\n{ACCEPTANCE_RUN}: gradient bytes per step {100 * (1 - fraction):.1f}% below dense "
          f"(target >= {100 * (1 - TARGET_BYTES_FRACTION):.0f}%): {'PASS' if bytes_ok else 'FAIL'}")
    print(f"{ACCEPTANCE_RUN}: final eval loss {ef.final_eval_loss:.4f} vs dense {dense.final_eval_loss:.4f}, "
          f"{100 * gap:.2f}% relative (target <= {100 * TARGET_EVAL_GAP:.0f}%): {'PASS' if eval_ok else 'FAIL'}")
    no_ef_gap = (no_ef.final_eval_loss - dense.final_eval_loss) / dense.final_eval_loss
    print(f"without error feedback (topk 0.01 no EF): final eval loss {no_ef.final_eval_loss:.4f}, "
          f"{100 * no_ef_gap:+.2f}% vs dense -- the gap error feedback closes")
    return bytes_ok and eval_ok


def _gradient_ops() -> tuple[str, ...]:
    from zerotune.distributed.compression import GRADIENT_OPS

    return GRADIENT_OPS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage of every run")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps, the same for every run")
    parser.add_argument("--eval-every", type=int, default=100, help="eval-loss points on the curve")
    parser.add_argument("--compression-warmup", type=int, default=0,
                        help="gradient_compression.warmup_steps: dense steps before Top-K starts")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="every run's optimizer (error feedback's guarantee is for SGD-style updates)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate of WarmupDecayLR "
                        "(default 2e-3 for AdamW, 0.1 for SGD)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--order", type=int, default=2, choices=(1, 2, 3),
                        help="tokens of context that fix the next one (2 needs attention to the previous two)")
    parser.add_argument("--noise", type=float, default=0.1, help="probability of a uniform next token")
    parser.add_argument("--eval-sequences", type=int, default=256)
    parser.add_argument("--out", default=DEFAULT_OUT, help="PNG of the loss curves")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for key in ("steps", "eval_every", "world", "threads", "layers", "width", "heads", "vocab", "seq", "micro",
                "eval_sequences"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 2e-3
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be divisible by --heads {args.heads}")
    if args.seq <= args.order or not 0.0 <= args.noise < 1.0 or args.compression_warmup < 0 or args.lr <= 0:
        parser.error("need --seq > --order, 0 <= --noise < 1, --compression-warmup >= 0 and --lr > 0")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    started = time.perf_counter()
    results = summarize(run_ranks(args))
    print(f"GPT-2 ({args.layers} layers, width {args.width}, vocab {args.vocab}) on an order-{args.order} Markov language "
          f"(noise {args.noise}), ZeRO stage {args.stage}, {args.world} gloo rank(s), micro-batch {args.micro} x seq "
          f"{args.seq}, {args.optimizer} lr {args.lr:g} WarmupDecayLR, {args.steps} interleaved steps per run, "
          f"compression warm-up {args.compression_warmup} step(s)")
    passed = report(results, args)
    plot(results, args.out, entropy_floor(args.vocab, args.noise),
         f"Top-K gradient compression, ZeRO stage {args.stage}, {args.world} ranks, {args.steps} steps")
    print(f"loss curves: {os.path.abspath(args.out)}")
    print(f"total {time.perf_counter() - started:.0f} s")
    if not passed:
        print(f"ACCEPTANCE NOT MET: {ACCEPTANCE_RUN} must move <= {100 * TARGET_BYTES_FRACTION:.0f}% of dense "
              f"gradient bytes per step and end within {100 * TARGET_EVAL_GAP:.0f}% of dense eval loss")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
