"""ZeRO stages 0, 1 and 2 against torch DDP, ZeroRedundancyOptimizer + DDP and FSDP2, one run.

    python benchmarks/bench_zero12.py                              # all methods, 2 gloo ranks on CPU
    python benchmarks/bench_zero12.py --methods ddp,stage1,stage2  # a subset
    python benchmarks/bench_zero12.py --steps 4 --warmup 1         # smoke test

Workload (as in bench_dp_vs_ddp.py): random-init GPT-2, 4 layers, width 256,
vocab 8192, sequence 128, micro-batch 4 per rank, AdamW, fp32, no clipping, one thread per rank.

Timing: every method is built in the same rank processes and their steps are interleaved in a
rotating order, so the machine's noise -- large on 2 shared cores -- hits all methods alike; a
step's time is the slowest rank's, and "x DDP" compares medians.

Memory: per-rank model state (params + grads + optimizer state + communication buffers), counted
as distinct tensor storages right after backward and right after the optimizer step (the larger
of the two), so gradients are counted whether or not a method frees them between steps. Both
DDP baselines use ``gradient_as_bucket_view=True``: their gradients then *are* DDP's buckets and
the storages count everything (with torch's default ``False`` DDP holds the buckets and separate
gradients, 20 Psi bytes, and the buckets are invisible from Python). FSDP2 counts the local
shards of its DTensors; zerotune counts every tensor reachable from the engine (its optimizer,
masters, gradient buckets and partitions), next to ``engine.memory_breakdown()`` when present.
The two can differ for stage 2: its buckets live only while in flight, so the snapshot after
backward sees the ones still in flight, while the breakdown reports their bound.

Communication: the zerotune stages' bytes for one optimizer step, read from
``zerotune.comm.comm_stats()`` (ZeRO paper convention), against theory's 2 x 4 x Psi bytes.

A zerotune stage whose ``initialize`` raises ``NotSupportedYetError`` is reported as
"not available"; a torch method that fails to build or to run its first step here is reported
as "not runnable here" with the exception.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import tempfile
import traceback
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dp_vs_ddp import (MODEL, _batch, _free_port, _storage_bytes, _timed,  # noqa: E402
                            add_workload_arguments, spawn_ranks, write_gathered)
from bench_table import (_mib, comm_columns, print_details, print_table, summarize,  # noqa: E402
                         time_and_state_columns, time_ratio)

METHODS = ("ddp", "zero_optimizer_ddp", "fsdp2", "stage0", "stage1", "stage2")
ZEROTUNE_STAGES = {"stage0": 0, "stage1": 1, "stage2": 2}


@dataclass
class Built:
    """One method ready to train: one step is ``forward_backward`` then ``optimizer_step``."""

    forward_backward: Callable[[int], None]
    optimizer_step: Callable[[], None]
    state_tensors: Callable[[], list[torch.Tensor]]
    breakdown: Callable[[], dict[str, int] | None] = lambda: None
    counts_comm: bool = False  # its collectives go through zerotune.comm


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The rank-local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


_LEAVES = (str, bytes, int, float, bool, complex, type(None), type, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, types.ModuleType)


def reachable_tensors(roots: Iterable[Any]) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots`` through containers and object attributes.

    Why a walk and not named fields: the stage 1/2 engine keeps gradient partitions and
    communication buffers in objects whose names this benchmark should not depend on. Modules
    are not entered (their parameters are counted by the caller); functions and closures are
    not followed.
    """
    found, seen, stack = [], set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES) or isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    stack.append(getattr(obj, slot))
    return found


def _build_ddp(model: torch.nn.Module, rank: int, args: argparse.Namespace, device: torch.device,
               sharded_optimizer: bool) -> Built:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    if sharded_optimizer:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        local_optimizer = optimizer.optim  # AdamW over this rank's share of the parameters
    else:
        optimizer = local_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward_backward(step: int) -> None:
        wrapped(**_batch(step, rank, args.micro, args.seq, device)).loss.backward()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def state_tensors() -> list[torch.Tensor]:
        params = list(model.parameters())
        return params + [p.grad for p in params] + _optimizer_state_tensors(local_optimizer)
    return Built(forward_backward, optimizer_step, state_tensors)


def _build_fsdp2(model: torch.nn.Module, rank: int, args: argparse.Namespace, device: torch.device,
                 reshard_after_forward: bool = False) -> Built:
    """``fully_shard`` per GPT2Block plus the root. ``reshard_after_forward=False`` keeps the gathered
    parameters until backward (ZeRO-2-like: no re-gather); ``True`` frees them after each block's
    forward and gathers again in backward (ZeRO-3-like)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (args.world,))
    for block in model.transformer.h:  # GPT2Block
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward_backward(step: int) -> None:
        model(**_batch(step, rank, args.micro, args.seq, device)).loss.backward()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def state_tensors() -> list[torch.Tensor]:
        params = list(model.parameters())
        tensors = params + [p.grad for p in params] + _optimizer_state_tensors(optimizer)
        return [_local(t) for t in tensors]
    return Built(forward_backward, optimizer_step, state_tensors)


def _build_zerotune(model: torch.nn.Module, stage: int, rank: int, args: argparse.Namespace,
                    device: torch.device, zero_overrides: dict[str, Any] | None = None) -> Built:
    """zerotune at ``stage``; ``zero_overrides`` adds or replaces ``zero_optimization`` keys."""
    import zerotune

    # Collectives use DDP's bucket bytes, except stage 2's reduce buckets: a stage-2 rank keeps
    # those on top of its gradient partition, so they are smaller. (Stage 1 holds full gradients
    # anyway, and all-gathers write in place into the parameters: large chunks cost no memory.)
    large = int(args.bucket_mb * 2**20 / 4)
    reduce_bucket = int(args.zero_bucket_mb * 2**20 / 4) if stage == 2 else large
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10**9,
              "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": reduce_bucket,
                                    "allgather_bucket_size": large, **(zero_overrides or {})}}
    engine, optimizer, _, _ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)

    def forward_backward(step: int) -> None:
        engine.backward(engine(**_batch(step, rank, args.micro, args.seq, device)).loss)

    def state_tensors() -> list[torch.Tensor]:
        engine_state = {key: value for key, value in vars(engine).items()
                        if key not in ("monitor", "reporter", "timers", "training_dataloader")}
        params = list(model.parameters())
        return params + [p.grad for p in params] + reachable_tensors([engine_state, optimizer])

    def breakdown() -> dict[str, int] | None:
        return dict(engine.memory_breakdown()) if hasattr(engine, "memory_breakdown") else None
    return Built(forward_backward, engine.step, state_tensors, breakdown, counts_comm=True)


def new_model(args: argparse.Namespace, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A fresh random-init GPT-2 of the workload, the same init every call (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**MODEL, n_ctx=args.seq, bos_token_id=0, eos_token_id=0)).to(device)


def build(method: str, rank: int, args: argparse.Namespace, device: torch.device) -> Built:
    """A fresh GPT-2 (same init for every method) wrapped by ``method``."""
    model = new_model(args, device)
    if method in ("ddp", "zero_optimizer_ddp"):
        return _build_ddp(model, rank, args, device, sharded_optimizer=method == "zero_optimizer_ddp")
    if method == "fsdp2":
        return _build_fsdp2(model, rank, args, device)
    return _build_zerotune(model, ZEROTUNE_STAGES[method], rank, args, device)


def _try(method: str, action: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``action``; a failure becomes the reason shown in the table instead of the run's end."""
    from zerotune.config import NotSupportedYetError

    try:
        return action(), None
    except NotSupportedYetError as error:
        return None, f"not available: {error}"
    except Exception as error:  # noqa: BLE001 - reported in the table; the other methods still run
        traceback.print_exc()
        kind = "not available" if method.startswith("stage") else "not runnable here"  # zerotune's own
        return None, f"{kind}: {type(error).__name__}: {error}"


def _agree(reasons: dict[str, str | None], world: int) -> dict[str, str | None]:
    """A method dropped on any rank is dropped on all, so the ranks keep issuing the same collectives."""
    gathered: list = [None] * world
    dist.all_gather_object(gathered, reasons)
    return {m: next((r[m] for r in gathered if r[m] is not None), None) for m in reasons}


def _measure_step(built: Built, step: int) -> dict:
    """One untimed step: model state after backward and after the update, and its comm volume."""
    from zerotune import comm

    comm.reset_comm_stats()
    built.forward_backward(step)
    after_backward = _storage_bytes(built.state_tensors())
    built.optimizer_step()
    stats = comm.comm_stats()
    return {"model_state_bytes": max(after_backward, _storage_bytes(built.state_tensors())),
            "breakdown": built.breakdown(),
            "comm_bytes": sum(s.bytes for s in stats.values()) if built.counts_comm else None,
            "comm_ops": {op: [s.calls, s.bytes] for op, s in stats.items()} if built.counts_comm else None}


def _train_step(built: Built, step: int) -> None:
    built.forward_backward(step)
    built.optimizer_step()


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str,
               builder: Callable[[str, int, argparse.Namespace, torch.device], Built] = build) -> None:
    """All methods in the same processes: built by ``builder``, warmed up (the first step may fail:
    then dropped), timed in a rotating order, then one measured step each."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    import zerotune

    device = zerotune.init_distributed().device
    built: dict[str, Built] = {}
    reasons: dict[str, str | None] = {}
    for method in args.methods:
        built[method], reasons[method] = _try(method, lambda: builder(method, rank, args, device))
    reasons = _agree(reasons, world)
    for method in [m for m in args.methods if reasons[m] is None]:
        reasons[method] = _try(method, functools.partial(_train_step, built[method], 0))[1]
    reasons = _agree(reasons, world)
    running = [m for m in args.methods if reasons[m] is None]
    for step in range(1, args.warmup):
        for method in running:
            _train_step(built[method], step)
    first = max(args.warmup, 1)
    times: dict[str, list[float]] = {m: [] for m in running}
    for step in range(args.steps):
        shift = step % max(len(running), 1)
        for method in running[shift:] + running[:shift]:
            times[method].append(_timed(functools.partial(_train_step, built[method]), first + step, device))
    measured = {m: _measure_step(built[m], first + args.steps) for m in running}
    write_gathered({"reasons": reasons, "times": times, "measured": measured}, out_dir)
    dist.destroy_process_group()


def run_ranks(args: argparse.Namespace,
              builder: Callable[[str, int, argparse.Namespace, torch.device], Built] = build) -> list[dict]:
    """Per-rank results of ``args.methods``, each built by ``builder`` (a module-level function: it is
    pickled into the spawned ranks)."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_rank_main, (args.world, _free_port(), args, out_dir, builder), args.world)
        with open(os.path.join(out_dir, "result.json")) as handle:
            return json.load(handle)


def model_numel(args: argparse.Namespace) -> int:
    """Psi: distinct parameter elements (GPT-2 ties the LM head to the token embedding)."""
    return sum(p.numel() for p in new_model(args).parameters())


def _parse_methods(text: str, choices: tuple[str, ...] = METHODS) -> tuple[str, ...]:
    chosen = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in chosen if m not in choices]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or [text]}; choose from {', '.join(choices)}")
    return chosen


def report(per_rank: list[dict], args: argparse.Namespace, psi: int) -> None:
    """One table: time and model state x DDP, model state against theory, zerotune comm against 2 x 4 x Psi."""
    summary = summarize(per_rank, args)
    ideal_comm = 2 * 4 * psi
    print(f"GPT-2 {MODEL} ({psi / 1e6:.2f}M params), {args.world} rank(s), micro-batch {args.micro} x seq "
          f"{args.seq}, AdamW fp32, {args.steps} interleaved steps per method; buckets: DDP/stage 0 "
          f"{args.bucket_mb:g} MiB, stage-2 reduce buckets {args.zero_bucket_mb:g} MiB")

    def breakdown(method: str) -> str:
        parts = summary.measured[method]["breakdown"]
        return _mib(sum(parts.values())) if parts else "-"
    print_table(args.methods, summary.reasons,
                time_and_state_columns(summary, args.world) + [("breakdown MiB", 13, breakdown)]
                + comm_columns(summary, lambda m: ideal_comm, "x 8Psi"))
    print(f"(theory: fp32 + Adam model state x DDP at N={args.world}; 8Psi = 2 x 4 x Psi = {_mib(ideal_comm)} MiB, "
          "the per-step volume of DP and ZeRO-1/2 in the ZeRO paper's convention)")
    print_details(summary)
    print(f"\nstep-time ratio stage1/DDP = {time_ratio(summary, 'stage1')}, "
          f"stage2/DDP = {time_ratio(summary, 'stage2')} (target <= 1.00)")


def benchmark_parser(doc: str, choices: tuple[str, ...], default: tuple[str, ...], bucket_help: str
                     ) -> argparse.ArgumentParser:
    """The workload arguments, --zero-bucket-mb and --methods (a comma-separated subset of ``choices``)."""
    parser = add_workload_arguments(
        argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--zero-bucket-mb", type=float, default=4.0, help=bucket_help)
    parser.add_argument("--methods", type=functools.partial(_parse_methods, choices=choices), default=default,
                        help=f"comma-separated subset of {','.join(choices)}")
    return parser


def parse_and_run(parser: argparse.ArgumentParser,
                  builder: Callable[[str, int, argparse.Namespace, torch.device], Built],
                  report_fn: Callable[[list[dict], argparse.Namespace, int], None]) -> None:
    """Parse the command line, run the methods on ``--world`` ranks and print ``report_fn``'s table."""
    args = parser.parse_args()
    if args.steps < 1 or args.world < 1:
        parser.error(f"--steps and --world must be >= 1 (got --steps {args.steps}, --world {args.world})")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # as bench_dp_vs_ddp.py: RSS then tracks live memory
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    report_fn(run_ranks(args, builder), args, model_numel(args))


def main() -> None:
    parser = benchmark_parser(__doc__, METHODS, METHODS,
                              "stage 2's reduce_bucket_size in MiB of fp32 (its in-flight gradient buckets)")
    parse_and_run(parser, build, report)


if __name__ == "__main__":
    main()
