"""Host (ZeRO-Offload) optimizer step throughput against this machine's memory bandwidth, one run.

    python benchmarks/bench_cpu_optimizer.py                     # 100M fp32 elements, ~1.5-2 min
    python benchmarks/bench_cpu_optimizer.py --numel 50e6 --rounds 3
    python benchmarks/bench_cpu_optimizer.py --skip-concurrent   # single process only

What is compared, all built through ``zerotune.offload.cpu_step.build_cpu_optimizer`` on one flat
fp32 tensor (as an offloaded master is):

- torch's three implementations (``fused``, ``foreach``, the default for-loop) of AdamW, Adam
  (L2-coupled), SGD with momentum and Adagrad, at each thread count of ``--threads``;
- the same AdamW stepped chunk by chunk (NVMe offload's pattern: one proxy parameter per
  ``sub_group_size`` chunk, only the stepped chunk holding a gradient) against the whole tensor;
- two processes stepping at once (two ranks on one node), 1 and 2 threads each;
- the default: ``build_cpu_optimizer`` + ``step_threads(cpu_step_threads(1))``.

Bytes counted: the state an element must touch at the least, each once -- AdamW/Adam read
param, grad, exp_avg, exp_avg_sq and write param, exp_avg, exp_avg_sq: 7 x 4 bytes; SGD with
momentum and Adagrad read param, grad, buffer and write param, buffer: 5 x 4 bytes. An
implementation making several passes moves more bytes than that, which is why it scores lower.

Memory bandwidth, measured in the same run and interleaved with the steps: ``dst.copy_(src)``
counted as 8 bytes per element (read + write; the hardware also reads ``dst`` to allocate its
cache lines, so this undercounts) and ``dst.add_(src)`` counted as 12 (the optimizers' own
in-place read-modify-write pattern). The reference is the best of these over all thread counts;
each line prints its ratio to it (target >= 0.7).

Timing: every case of a group is run once per round, rounds interleaved, and the median is
kept, so the machine's noise (large on shared cores) hits all cases alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zerotune.offload.cpu_step import (
    build_cpu_optimizer,
    cpu_step_threads,
    step_implementation,
    step_threads,
)

# type name, DeepSpeed params, bytes of state per element (see the module docstring).
OPTIMIZERS = {
    "AdamW": ("AdamW", {"lr": 1e-4, "weight_decay": 0.01}, 28),
    "Adam": ("Adam", {"lr": 1e-4, "weight_decay": 0.01, "adam_w_mode": False}, 28),
    "SGD+momentum": ("SGD", {"lr": 1e-4, "momentum": 0.9}, 20),
    "Adagrad": ("Adagrad", {"lr": 1e-4}, 20),
}
IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def timed_rounds(cases: dict[str, tuple[Callable[[], None], int]], rounds: int) -> dict[str, float]:
    """Median seconds per case; ``cases``: label -> (fn, threads). One warm-up call each, then interleaved rounds."""
    times: dict[str, list[float]] = {label: [] for label in cases}
    for round_index in range(rounds + 1):
        for label, (fn, threads) in cases.items():
            with step_threads(threads):
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
            if round_index:
                times[label].append(elapsed)
    return {label: statistics.median(values) for label, values in times.items()}


def with_grad(numel: int, seed: int = 0) -> torch.nn.Parameter:
    generator = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(numel, generator=generator))
    param.grad = torch.randn(numel, generator=generator)
    return param


def bandwidth_cases(src: torch.Tensor, dst: torch.Tensor, threads: list[int]) -> dict:
    cases = {}
    for n in threads:
        cases[f"copy_ t={n}"] = (lambda: dst.copy_(src), n)
        cases[f"add_ t={n}"] = (lambda: dst.add_(src), n)
    return cases


def bandwidth_bytes(label: str, numel: int) -> int:
    return (8 if label.startswith("copy_") else 12) * numel


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_single_process(args: argparse.Namespace) -> float:
    numel, threads = args.numel, args.threads
    param = with_grad(numel)
    scratch = torch.empty(numel)
    bandwidth_samples: dict[str, list[float]] = {}

    def measure(group: dict) -> dict[str, float]:
        cases = {**bandwidth_cases(param.grad, scratch, threads), **group}
        medians = timed_rounds(cases, args.rounds)
        for label in cases:
            if label.startswith(("copy_", "add_")):
                bandwidth_samples.setdefault(label, []).append(gbps(bandwidth_bytes(label, numel), medians[label]))
        return medians

    results: list[tuple[str, float, int]] = []
    for name, (opt_type, hyper, nbytes) in OPTIMIZERS.items():
        group = {}
        for impl, knob in IMPLEMENTATIONS.items():
            optimizer = build_cpu_optimizer(opt_type, {**hyper, **knob}, [param])
            assert step_implementation(optimizer) == impl
            # AdamW (the main case) and every fused kernel at each thread count; the slow ones at the first only.
            for n in threads if (name == "AdamW" or impl == "fused") else threads[:1]:
                group[f"{name} {impl} t={n}"] = (optimizer.step, n)
        for label, seconds in measure(group).items():
            if not label.startswith(("copy_", "add_")):
                results.append((label, seconds, nbytes * numel))
        del group, optimizer

    bandwidth = {label: statistics.median(v) for label, v in bandwidth_samples.items()}
    reference = max(bandwidth.values())
    print(f"\nmemory bandwidth ({numel / 1e6:.0f}M fp32 elements, medians of all groups' rounds):")
    for label, value in bandwidth.items():
        counted = "read+write 8 B/elem" if label.startswith("copy_") else "2 reads+1 write 12 B/elem"
        print(f"  {label:<12} {value:6.1f} GB/s   ({counted})")
    print(f"  reference = best = {reference:.1f} GB/s")
    print(f"\noptimizer step ({numel / 1e6:.0f}M elements; AdamW/Adam 28 B/elem, SGD+momentum/Adagrad 20 B/elem):")
    for label, seconds, nbytes in results:
        print(f"  {label:<26} {seconds * 1e3:7.1f} ms  {gbps(nbytes, seconds):6.1f} GB/s  ratio {gbps(nbytes, seconds) / reference:.2f}")

    run_chunked(args, param, reference)
    run_default(args, param, reference)
    return reference


def run_chunked(args: argparse.Namespace, param: torch.nn.Parameter, reference: float) -> None:
    """AdamW fused, whole tensor vs NVMe-style chunks (one proxy per chunk, only the stepped one has a grad)."""
    whole = build_cpu_optimizer("AdamW", OPTIMIZERS["AdamW"][1], [param])
    print("\nchunked AdamW fused (NVMe offload steps one sub_group_size chunk at a time):")
    for chunk in args.chunks:
        step_chunk_by_chunk, count = chunked_stepper(param, chunk)
        cases = {}
        for n in args.threads:
            cases[f"whole t={n}"] = (whole.step, n)
            cases[f"chunked t={n}"] = (step_chunk_by_chunk, n)
        medians = timed_rounds(cases, args.rounds)
        del step_chunk_by_chunk, cases  # frees this chunking's optimizer state before the next is built
        for n in args.threads:
            seconds, baseline = medians[f"chunked t={n}"], medians[f"whole t={n}"]
            print(f"  chunk {chunk / 1e6:6.2f}M ({count:4d} chunks) t={n}: {seconds * 1e3:7.1f} ms vs whole "
                  f"{baseline * 1e3:7.1f} ms -> chunking costs {(seconds / baseline - 1) * 100:+6.1f}%  "
                  f"ratio {gbps(28 * args.numel, seconds) / reference:.2f}")


def chunked_stepper(param: torch.nn.Parameter, chunk: int) -> tuple[Callable[[], None], int]:
    """A step over ``param`` in ``chunk``-element proxies (views), stepped one at a time, and the chunk count."""
    proxies = [torch.nn.Parameter(view) for view in param.detach().split(chunk)]
    grads = param.grad.split(chunk)
    optimizer = build_cpu_optimizer("AdamW", OPTIMIZERS["AdamW"][1], proxies)

    def step_chunk_by_chunk() -> None:
        for proxy, grad in zip(proxies, grads):
            proxy.grad = grad
            optimizer.step()
            proxy.grad = None

    return step_chunk_by_chunk, len(proxies)


def run_default(args: argparse.Namespace, param: torch.nn.Parameter, reference: float) -> None:
    optimizer = build_cpu_optimizer("AdamW", OPTIMIZERS["AdamW"][1], [param])
    threads = cpu_step_threads(1)
    seconds = timed_rounds({"default": (optimizer.step, threads)}, args.rounds)["default"]
    rate = gbps(28 * args.numel, seconds)
    print(f"\nchosen default (1 rank on this node): build_cpu_optimizer('AdamW') -> {step_implementation(optimizer)}, "
          f"step_threads(cpu_step_threads(1)={threads}): {seconds * 1e3:.1f} ms, {rate:.1f} GB/s, "
          f"ratio {rate / reference:.2f}")


def _concurrent_rank(rank: int, numel: int, threads: int, rounds: int, barrier, queue) -> None:
    """One of two ranks stepping at once: barrier, then time copy_/add_ and AdamW in the shared monotonic clock."""
    torch.set_num_threads(1)
    param = with_grad(numel, seed=rank)
    scratch = torch.empty(numel)
    optimizer = build_cpu_optimizer("AdamW", OPTIMIZERS["AdamW"][1], [param])
    ops = {"add_": lambda: scratch.add_(param.grad), "AdamW fused": optimizer.step}
    spans = []
    for round_index in range(rounds + 1):
        for label, op in ops.items():
            barrier.wait()
            with step_threads(threads):
                start = time.monotonic()
                op()
                spans.append((round_index, label, start, time.monotonic()))
    queue.put(spans)


def run_concurrent(args: argparse.Namespace, reference: float) -> None:
    """Two ranks stepping at once (each ``numel / 2`` elements): the aggregate rate and the slowest rank's time."""
    numel = args.numel // 2
    context = mp.get_context("spawn")
    print(f"\ntwo ranks stepping at once ({numel / 1e6:.0f}M elements each; time = first start to last end):")
    for threads in args.threads:
        barrier, queue = context.Barrier(2), context.SimpleQueue()
        ranks = [context.Process(target=_concurrent_rank, args=(r, numel, threads, args.rounds, barrier, queue))
                 for r in range(2)]
        for process in ranks:
            process.start()
        spans = queue.get() + queue.get()
        for process in ranks:
            process.join()
        for label, nbytes in (("add_", 12), ("AdamW fused", 28)):
            makespans = []
            for round_index in range(1, args.rounds + 1):
                mine = [(s, e) for r, lab, s, e in spans if r == round_index and lab == label]
                makespans.append(max(e for _, e in mine) - min(s for s, _ in mine))
            seconds = statistics.median(makespans)
            rate = gbps(2 * nbytes * numel, seconds)
            print(f"  {threads} thread(s) per rank, {label:<12} {seconds * 1e3:7.1f} ms  aggregate {rate:6.1f} GB/s  "
                  f"ratio {rate / reference:.2f}")
    print(f"  default: cpu_step_threads(local_world_size=2) = {cpu_step_threads(2)} thread(s) per rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=100e6, help="fp32 elements of the flat master (default 100M)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (median kept)")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="comma-separated torch thread counts to try (default 1..cores)")
    parser.add_argument("--chunks", type=lambda s: [int(float(x)) for x in s.split(",")], default=[1_000_000, 10_000_000],
                        help="chunk sizes (elements) for the chunked step (default 1e6,1e7)")
    parser.add_argument("--skip-concurrent", action="store_true", help="skip the two-process run")
    args = parser.parse_args()
    args.numel = int(args.numel)
    args.threads = args.threads or list(range(1, min(os.cpu_count() or 1, 4) + 1))
    torch.set_num_threads(1)  # as a training rank runs; each case sets its own count
    started = time.perf_counter()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads tried {args.threads}, load average {os.getloadavg()[0]:.1f} (other work on the cores skews every figure)")
    reference = run_single_process(args)
    if not args.skip_concurrent:
        run_concurrent(args, reference)
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
