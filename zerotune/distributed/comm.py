"""THE collective layer: every collective zerotune issues goes through these functions.

Two reasons to route everything here:

* accounting -- each call adds its communication volume to a per-op counter, so tests and
  benchmarks can check the per-step volume against theory (read with ``comm_stats()``, reset
  with ``reset_comm_stats()``). Volume follows the ZeRO paper's convention, in bytes of the
  full logical tensor: an all-reduce of S bytes counts 2S (it is a reduce-scatter plus an
  all-gather), a reduce-scatter counts its full input S, an all-gather its full output S, a
  reduce or broadcast its tensor S, an all-to-all its input S (what each rank sends). Data parallel then
  moves 2 x model bytes per step, as do ZeRO stages 1 and 2 (reduce-scatter + all-gather), and stage 3 moves 3x; while
  DeepSpeed's comms_logger profiles, a call's latency goes to the comms log too (``comm_timing.py``);
* failure reporting -- a collective that fails or times out (a dead or diverging rank) is
  re-raised as ``CommError`` naming the op, this rank and the group size, instead of a bare
  gloo/NCCL message from deep inside; one still pending after ``comm_timeout_s`` is reported and
  ends the process (``watchdog.py``);
* agreement -- each call is folded into its group's running record, which ranks compare before every
  engine phase that communicates (``guard_point``), so ranks whose collectives diverge stop at once with
  ``CollectiveMismatch`` instead of pairing unrelated collectives (``guard.py``).

The guard and the watchdog timeout a call reports to are its engine's: ``guard_scope.current_scope()`` (the
engine whose method is running, else the one that ran last). The byte counters are the process's.

A group of ``None`` from ``ProcessMesh.group`` means an axis of size 1: nothing to do.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from zerotune.distributed import comm_timing
from zerotune.distributed.guard import (
    CollectiveGuard,
    CollectiveMismatch,
    PendingExchange,
    call_site,
    mismatch_message,
    setup_differences,
)
from zerotune.distributed.guard_scope import GuardScope, current_scope
from zerotune.distributed.guard_stall import published_verdict
from zerotune.distributed.watchdog import WATCHDOG

ReduceOp = dist.ReduceOp
_Gathered = TypeVar("_Gathered")  # what each rank contributes to all_gather_object


class CommError(RuntimeError):
    """A collective failed or timed out; the message says which one and on which rank."""


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0


_stats: dict[str, OpStats] = defaultdict(OpStats)


def comm_stats() -> dict[str, OpStats]:
    """Per-op counters since the last reset: {"all_reduce": OpStats(calls, bytes), ...}."""
    return {op: OpStats(s.calls, s.bytes) for op, s in _stats.items()}


def total_comm_bytes() -> int:
    return sum(s.bytes for s in _stats.values())


def reset_comm_stats() -> None:
    _stats.clear()


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _describe_failure(op: str, group: dist.ProcessGroup | None, error: Exception) -> CommError | CollectiveMismatch:
    verdict = published_verdict(current_scope().guard)  # the peer left: stalled ranks found diverging collectives
    if verdict is not None:
        return CollectiveMismatch(verdict)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CommError(
        f"{op} failed on global rank {rank} (group of {_group_size(group)} ranks): {error}. "
        "Another rank probably died, timed out or issued a different collective; see its log."
    )


class Handle:
    """An in-flight collective; ``wait()`` re-raises failures as CommError."""

    def __init__(self, op: str, group: dist.ProcessGroup | None, work: dist.Work | None,
                 on_done: Callable[[], None] | None = None) -> None:
        self._op, self._group, self._work, self._on_done = op, group, work, on_done

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as error:  # noqa: BLE001 - re-raised with context
                raise _describe_failure(self._op, self._group, error) from error
            self._work = None
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


def run_collective(op: str, group: dist.ProcessGroup | None, nbytes: int, launch: Callable[[], dist.Work | None],
                   async_op: bool, dtype: torch.dtype | None = None, peer: int | None = None) -> Handle:
    """Count ``nbytes`` under ``op``, record it for the guard, launch, and wait unless ``async_op``; failures
    become CommError. Every collective, zerotune's own and those issued through ``zerotune.comm``, passes
    here (``peer``: the other end of a point-to-point transfer)."""
    scope = current_scope()
    if scope.guard.pending is not None:
        _settle(scope.guard)
    stats = _stats[op]
    stats.calls += 1
    stats.bytes += nbytes
    token = _begin(scope, op, group, _group_size(group), nbytes, dtype, peer)
    timed = comm_timing.start(op, nbytes, _group_size(group))  # the comms log's latency, when profiling
    try:
        work = launch()
    except Exception as error:  # noqa: BLE001 - re-raised with context
        WATCHDOG.end(token)
        raise _describe_failure(op, group, error) from error
    handle = Handle(op, group, work, on_done=timed)
    if not async_op:
        try:
            handle.wait()
        finally:
            WATCHDOG.end(token)
    else:
        WATCHDOG.issued(token, handle)
    return handle


def _begin(scope: GuardScope, op: str, group: dist.ProcessGroup | None, ranks: int, nbytes: int,
           dtype: torch.dtype | None, peer: int | None) -> int | None:
    """Record a collective in ``scope``'s guard and register it with the watchdog under ``scope``'s timeout;
    returns the watchdog's token."""
    guard = scope.guard
    site = call_site() if guard.active or scope.timeout_s is not None else ""
    record = guard.record(op, group, dtype, nbytes, site, peer) if guard.active else None
    return WATCHDOG.begin(op, ranks, nbytes, site, record, timeout_s=scope.timeout_s, guard=guard)


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextmanager
def _watched(op: str, group: dist.ProcessGroup | None, ranks: int, nbytes: int, peer: int | None = None,
             dtype: torch.dtype | None = None) -> Iterator[None]:
    """A blocking call outside ``run_collective``: recorded for the guard, known to the watchdog while it waits
    (the caller settles the guard first, outside its error handling)."""
    token = _begin(current_scope(), op, group, ranks, nbytes, dtype, peer)
    try:
        yield
    finally:
        WATCHDOG.end(token)


def on_the_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as a collective should carry it: itself, or a copy in ``dtype`` (``communication_data_type``:
    bf16 / fp16 halve the bytes of fp32 gradients). The caller copies a reduced copy's result back."""
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=ReduceOp.SUM,
               async_op: bool = False) -> Handle:
    """In-place all-reduce of ``tensor`` over ``group``."""
    if group is None:
        return Handle("all_reduce", None, None)
    return run_collective("all_reduce", group, 2 * _nbytes(tensor),
                lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op, tensor.dtype)


def broadcast(tensor: torch.Tensor, src_rank_in_group: int, group: dist.ProcessGroup | None,
              async_op: bool = False) -> Handle:
    """Broadcast from the rank with index ``src_rank_in_group`` inside ``group``."""
    if group is None:
        return Handle("broadcast", None, None)
    return run_collective("broadcast", group, _nbytes(tensor),
                lambda: dist.broadcast(tensor, group_src=src_rank_in_group, group=group, async_op=async_op),
                async_op, tensor.dtype)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                          op=ReduceOp.SUM, async_op: bool = False) -> Handle:
    """Reduce ``input`` (group size x output numel) and keep this rank's chunk in ``output``."""
    if group is None:
        output.copy_(input)
        return Handle("reduce_scatter", None, None)
    return run_collective("reduce_scatter", group, _nbytes(input),
                lambda: _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op),
                async_op, input.dtype)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                           async_op: bool = False, counter: str = "all_gather") -> Handle:
    """Gather every rank's ``input`` into the flat ``output`` (rank order). ``counter`` names the
    statistics entry (compressed gradients count as "sparse_all_gather", apart from parameter gathers)."""
    if group is None:
        output.copy_(input)
        return Handle(counter, None, None)
    return run_collective(counter, group, _nbytes(output),
                lambda: _all_gather_single(output, input, group=group, async_op=async_op), async_op, input.dtype)


def all_gather(outputs: list[torch.Tensor], input: torch.Tensor, group: dist.ProcessGroup | None,
               async_op: bool = False) -> Handle:
    """Gather every rank's ``input`` into ``outputs[rank]`` (views into a larger buffer are fine)."""
    if group is None:
        outputs[0].copy_(input)
        return Handle("all_gather", None, None)
    return run_collective("all_gather", group, sum(_nbytes(o) for o in outputs),
                lambda: dist.all_gather(outputs, input, group=group, async_op=async_op), async_op, input.dtype)


def reduce_scatter(output: torch.Tensor, inputs: list[torch.Tensor], group: dist.ProcessGroup | None,
                   op=ReduceOp.SUM, async_op: bool = False) -> Handle:
    """Reduce ``inputs[r]`` over ranks into rank r's ``output`` (list form: inputs may be views)."""
    if group is None:
        if output.data_ptr() != inputs[0].data_ptr():
            output.copy_(inputs[0])
        return Handle("reduce_scatter", None, None)
    return run_collective("reduce_scatter", group, sum(_nbytes(i) for i in inputs),
                lambda: dist.reduce_scatter(output, inputs, op=op, group=group, async_op=async_op), async_op,
                output.dtype)


def reduce(tensor: torch.Tensor, dst_rank_in_group: int, group: dist.ProcessGroup | None, op=ReduceOp.SUM,
           async_op: bool = False) -> Handle:
    """Sum ``tensor`` over ``group`` into the rank with index ``dst_rank_in_group`` (others: undefined)."""
    if group is None:
        return Handle("reduce", None, None)
    return run_collective("reduce", group, _nbytes(tensor),
                lambda: dist.reduce(tensor, group_dst=dst_rank_in_group, op=op, group=group, async_op=async_op),
                async_op, tensor.dtype)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                      async_op: bool = False) -> Handle:
    """Split ``input`` into group-size equal chunks along dim 0; chunk r goes to rank r, and what
    rank r sent lands in ``output``'s chunk r. Counted as the input's bytes (what each rank sends)."""
    if group is None:
        output.copy_(input)
        return Handle("all_to_all", None, None)
    return run_collective("all_to_all", group, _nbytes(input),
                lambda: dist.all_to_all_single(output, input, group=group, async_op=async_op), async_op,
                input.dtype)


def send(tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
    """Point-to-point send to global rank ``dst`` (asynchronous: wait on the handle before reusing
    ``tensor``). Counted as the tensor's bytes."""
    return run_collective("send", None, _nbytes(tensor), lambda: dist.isend(tensor, dst=dst, tag=tag), async_op=True,
                          dtype=tensor.dtype, peer=dst)


def recv(tensor: torch.Tensor, src: int, tag: int = 0) -> None:
    """Blocking point-to-point receive from global rank ``src`` into ``tensor`` (not counted: the sender counts)."""
    settle_guard()
    try:
        with _watched("recv", None, 2, _nbytes(tensor), peer=src, dtype=tensor.dtype):
            dist.recv(tensor, src=src, tag=tag)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise _describe_failure(f"recv from rank {src}", None, error) from error


def all_gather_object(obj: _Gathered, group: dist.ProcessGroup | None) -> list[_Gathered]:
    """Small Python objects from every rank (configs, shapes, checks), each rank's of the same type; not counted as
    tensor traffic."""
    if group is None:
        return [obj]
    gathered = [obj] * dist.get_world_size(group)  # placeholders: all_gather_object replaces each
    settle_guard()
    try:
        with _watched("all_gather_object", group, len(gathered), 0):
            dist.all_gather_object(gathered, obj, group=group)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise _describe_failure("all_gather_object", group, error) from error
    return gathered


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (default: the whole world)."""
    if group is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return
    settle_guard()
    try:
        with _watched("barrier", group, _group_size(group) if group is not None else dist.get_world_size(), 0):
            dist.barrier(group=group)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise _describe_failure("barrier", group, error) from error


def guard_point(phase: str, step: int, micro_step: int) -> None:
    """Compare every rank's collective record before an engine phase that communicates (``guard.py``): one
    small all-gather on the guard's own group, neither counted nor recorded. It is launched here and waited
    for by this rank's next collective (``settle_guard``), so it overlaps the phase's computation; no data
    collective is issued before the records agree. On any difference every rank raises
    ``CollectiveMismatch`` naming each rank's phase and last collectives. The guard is the running engine's."""
    guard = current_scope().guard
    _settle(guard)
    group = guard.group
    if group is None:
        return
    started = time.perf_counter()
    guard.points += 1
    row = guard.vector(phase, step, micro_step)
    rows = torch.empty(dist.get_world_size(group) * row.numel(), dtype=row.dtype)
    try:
        work = (guard.backend._allgather_base(rows, row) if guard.backend is not None
                else _all_gather_single(rows, row, group=group, async_op=True))
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise _describe_failure(f"collective guard exchange before {phase}", group, error) from error
    launch_s = time.perf_counter() - started
    guard.pending = PendingExchange(work, rows, phase, step, micro_step, started, launch_s)
    guard.seconds += launch_s


def settle_guard() -> None:
    """Wait for the running engine's guard exchange in flight, if any, and raise ``CollectiveMismatch`` if the
    records differ."""
    _settle(current_scope().guard)


def _settle(guard: CollectiveGuard) -> None:
    pending, guard.pending = guard.pending, None
    if pending is None or guard.group is None:
        return
    group, world = guard.group, dist.get_world_size(guard.group)
    phase = pending.phase
    started = time.perf_counter()
    try:
        with _watched_only(f"collective guard before {phase}", world,
                           phase=f"{phase} (step {pending.step}, micro-step {pending.micro_step})"):
            pending.work.wait()
            problems = guard.disagreements(pending.rows.view(world, -1))
            if problems:
                described: list[dict] = [{}] * world  # placeholders: all_gather_object replaces each
                dist.all_gather_object(described, guard.describe(phase, pending.step, pending.micro_step),
                                       group=group)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise _describe_failure(f"collective guard exchange before {phase}", group, error) from error
    ended = time.perf_counter()
    guard.seconds += ended - started
    if guard.timings is not None:
        guard.timings.append((pending.arrived, pending.launch_s, started, ended))
    if problems:
        raise CollectiveMismatch(mismatch_message(described, problems))
    guard.adapt(pending.rows.view(world, -1))


def check_same_setup(config: dict, model_signature: list[str], model_peers: tuple[int, ...]) -> None:
    """At ``initialize``, while the guard is armed: every rank's config must be the same, and the model
    pieces of ranks that hold the same piece (``model_peers``, this rank's data-parallel group) alike --
    ranks started differently would otherwise pair unrelated collectives from their first step.
    ``model_signature``: each parameter's name, shape and dtype. The guard is the running engine's."""
    guard = current_scope().guard
    _settle(guard)
    group = guard.group
    if group is None:
        return
    setups: list[dict] = [{}] * dist.get_world_size(group)  # placeholders: all_gather_object replaces each
    try:
        with _watched_only("initialize: compare configs", len(setups)):
            dist.all_gather_object(setups, {"config": config, "model": model_signature, "peers": model_peers},
                                   group=group)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise _describe_failure("initialize: compare configs", group, error) from error
    differences = setup_differences([setup["config"] for setup in setups])
    if differences:
        raise CollectiveMismatch("ranks were started with different configs (each would issue different "
                                 "collectives):\n" + "\n".join(differences))
    for rank, setup in enumerate(setups):
        theirs = setup["model"]
        if setup["peers"] == model_peers and theirs != model_signature:
            first = next((i for i, (a, b) in enumerate(zip(theirs, model_signature)) if a != b),
                         min(len(theirs), len(model_signature)))
            raise CollectiveMismatch(
                f"ranks {rank} and {guard.rank} should hold the same model but differ at parameter {first}: rank "
                f"{rank} has {theirs[first] if first < len(theirs) else '<none>'}, rank {guard.rank} has "
                f"{model_signature[first] if first < len(model_signature) else '<none>'}")


@contextmanager
def _watched_only(op: str, ranks: int, phase: str | None = None) -> Iterator[None]:
    """The guard's own exchanges: known to the watchdog (as waiting at ``phase``'s guard point), not recorded."""
    scope = current_scope()
    token = WATCHDOG.begin(op, ranks, 0, call_site(), phase=phase, timeout_s=scope.timeout_s, guard=scope.guard)
    try:
        yield
    finally:
        WATCHDOG.end(token)
