"""Run a test function on N gloo ranks, using a persistent pool of worker processes.

Why a pool: spawning processes per test costs 4-8 s on a 2-core machine (importing torch
dominates), while a warm pool runs a small parity test in tens of milliseconds. So there is
one pool per world size, started on first use, kept for the whole pytest session, and thrown
away (recycled) only when a call fails, because a failed or abandoned collective leaves the
gloo group in an unknown state.

How it works:
- Workers are forked from a multiprocessing *forkserver* that has already imported torch
  (and transformers' tiny test models, when installed), so a new worker costs a fork, not
  an import.
- The parent hosts the rendezvous TCPStore on a kernel-chosen port (no free-port race) and
  exports it as MASTER_ADDR/MASTER_PORT; each worker joins the default gloo group once, so
  `zerotune.init_distributed()` finds an initialized group consistent with the environment.
- A new pool reports readiness (or each rank's startup traceback) before the first task, so
  a call's timeout never includes the warm-up.
- A task is `pickle((fn, args, kwargs))` sent down a pipe; the reply is
  `("ok", value, finished_at)` or `("error", formatted traceback, finished_at)` (the time
  orders failures, to point at the rank that failed first). After reporting success every rank
  enters a barrier, so no rank starts the next task while another still runs this one, and
  then destroys the subgroups the task created (each gloo group holds sockets and threads).
- A rank that raised reports, then exits: peers stuck in a collective with it fail fast
  with a connection error instead of waiting for the gloo timeout.
- On timeout the parent asks each unfinished worker for its Python stack (faulthandler on
  SIGUSR1, written to a per-worker file), kills the pool and raises.
- Workers die with the parent: a daemon thread blocks on a "lifeline" pipe whose other end
  only the parent holds, and exits the worker on EOF.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tests.logs import logger_state_restored

# How long one collective may block inside a worker before gloo itself raises. Deliberately
# longer than any sensible per-call timeout: the parent's timeout is what turns a hang into
# a test failure (with stacks); this only bounds workers the parent has forgotten.
GROUP_TIMEOUT_S = 300.0
# After one rank fails, how long to wait for the others to report (they usually fail fast
# with a connection error because the failed rank exits) before calling them stuck.
FAILURE_GRACE_S = 3.0
# How long to wait for a SIGUSR1 stack dump to appear in a worker's stack file.
STACK_DUMP_WAIT_S = 2.0
# How long a new pool may take to start (fork, join the gloo group). Separate from the
# per-call timeout so a short timeout on the first call of a session is not eaten by warm-up,
# which takes 5-15 s on a busy 2-core machine while the forkserver imports torch/transformers.
POOL_START_TIMEOUT_S = 180.0
# Time for a healthy pool to exit after being asked to, before it is killed.
SHUTDOWN_WAIT_S = 2.0

# Imported once in the forkserver, shared by every worker. Transformers' model modules take
# several seconds to import; importing them once instead of once per worker is what makes a
# fresh 8-rank pool affordable for tests with tiny HF models.
_TRANSFORMERS_PRELOAD = [
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
]


class DistributedTestError(AssertionError):
    """A multi-rank call failed or hung; the message holds every rank's traceback or stack.

    `failed_ranks` raised an exception (or their process died); `first_failed_rank` is the
    one that failed earliest (the others often only fail because it left a collective);
    `hung_ranks` had not answered when the call was given up on.
    """

    def __init__(
        self, message: str, failed_ranks: list[int], first_failed_rank: int | None, hung_ranks: list[int]
    ) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.first_failed_rank = first_failed_rank
        self.hung_ranks = hung_ranks


@dataclass
class _Pool:
    """The live workers of one world size and the parent-side ends of their pipes."""

    world_size: int
    processes: list[multiprocessing.process.BaseProcess]
    task_pipes: list[multiprocessing.connection.Connection]
    lifelines: list[multiprocessing.connection.Connection]  # held open only to keep workers alive
    stack_files: list[Path]
    workdir: Path
    store: dist.TCPStore


_pools: dict[int, _Pool] = {}


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run fn(*args, **kwargs) on every rank of a world_size gloo group; return the list of per-rank return values (rank order).

    fn must be a module-level function (workers import it by name). `timeout` bounds the
    whole call; it is the harness's own keyword and is never passed on to fn. Raises
    DistributedTestError if any rank raises, dies or does not finish within `timeout`; the
    pool of that world size is then recycled.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    try:
        task = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_distributed could not pickle {fn!r} with its arguments ({exc}); fn must be a "
            "module-level function of an importable module (no lambdas, closures or nested "
            "functions) and its arguments must be picklable"
        ) from exc

    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = _start_pool(world_size)
    try:
        for pipe in pool.task_pipes:
            pipe.send_bytes(task)
        outcomes, hung = _collect_outcomes(pool, timeout)
    except BaseException:
        _discard_pool(world_size)  # e.g. Ctrl-C mid-call: the workers are in an unknown state
        raise
    if not hung and all(status == "ok" for status, _, _ in outcomes.values()):
        return [outcomes[rank][1] for rank in range(world_size)]

    stacks = _dump_stacks(pool, hung)
    _discard_pool(world_size)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    raise _build_error(f"run_distributed({name}, world_size={world_size})", timeout, outcomes, hung, stacks)


def shutdown_pools() -> None:
    """Stop every pool: ask workers to exit, kill those that do not. Safe to call twice."""
    for world_size in list(_pools):
        pool = _pools.pop(world_size)
        for pipe in pool.task_pipes:
            try:
                pipe.send_bytes(b"")  # empty task = exit
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for process in pool.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        _kill_pool(pool)


atexit.register(shutdown_pools)


def worker_pids(world_size: int) -> list[int]:
    """Pids of the live pool of this world size (empty if none); lets tests observe reuse."""
    pool = _pools.get(world_size)
    return [process.pid for process in pool.processes] if pool else []


# ----------------------------------------------------------------------------- parent side


def _forkserver_context() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    # pytest too: every test module imports it, and a fresh worker would otherwise pay ~0.1 s for it
    # inside the first call's timeout.
    preload = ["torch", "torch.distributed", "pytest", __name__]
    if importlib.util.find_spec("transformers") is not None:
        preload += _TRANSFORMERS_PRELOAD
    context.set_forkserver_preload(preload)
    return context


def _start_pool(world_size: int) -> _Pool:
    """Fork world_size workers and wait until all have joined the gloo group.

    They rendezvous through a store hosted by this process; each reports once it is ready
    (or its startup traceback), exactly like a task result.
    """
    context = _forkserver_context()
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    workdir = Path(tempfile.mkdtemp(prefix=f"zerotune-pool{world_size}-"))
    pool = _Pool(world_size, [], [], [], [], workdir, store)
    try:
        _start_workers(context, pool)
        outcomes, hung = _collect_outcomes(pool, POOL_START_TIMEOUT_S)
    except BaseException:
        _kill_pool(pool)
        raise
    if hung or any(status != "ok" for status, _, _ in outcomes.values()):
        stacks = _dump_stacks(pool, hung)
        _kill_pool(pool)
        title = f"starting a pool of {world_size} gloo workers"
        raise _build_error(title, POOL_START_TIMEOUT_S, outcomes, hung, stacks)
    return pool


def _start_workers(context: multiprocessing.context.BaseContext, pool: _Pool) -> None:
    world_size = pool.world_size
    for rank in range(world_size):
        parent_end, worker_end = context.Pipe(duplex=True)
        lifeline_read, lifeline_write = context.Pipe(duplex=False)
        stack_file = pool.workdir / f"rank{rank}.stack"
        process = context.Process(
            target=_worker_main,
            args=(rank, world_size, pool.store.port, worker_end, lifeline_read, str(stack_file)),
            name=f"zerotune-test-rank{rank}-of-{world_size}",
        )
        process.start()
        worker_end.close()
        lifeline_read.close()
        pool.processes.append(process)
        pool.task_pipes.append(parent_end)
        pool.lifelines.append(lifeline_write)
        pool.stack_files.append(stack_file)


def _collect_outcomes(
    pool: _Pool, timeout: float
) -> tuple[dict[int, tuple[str, Any, float]], list[int]]:
    """Wait for every rank's reply; return {rank: (status, value, finished_at)} and the ranks that
    never answered. finished_at is the worker's time.time() when it finished, to order failures.

    Once a rank has failed, the others get FAILURE_GRACE_S more (not the full timeout):
    they are often blocked in a collective with the failed rank.
    """
    deadline = time.monotonic() + timeout
    pending = {pipe: rank for rank, pipe in enumerate(pool.task_pipes)}
    outcomes: dict[int, tuple[str, Any, float]] = {}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for pipe in multiprocessing.connection.wait(list(pending), timeout=remaining):
            rank = pending.pop(pipe)
            outcomes[rank] = _receive_outcome(pool, rank, pipe)
            if outcomes[rank][0] != "ok":
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return outcomes, sorted(pending.values())


def _receive_outcome(
    pool: _Pool, rank: int, pipe: multiprocessing.connection.Connection
) -> tuple[str, Any, float]:
    try:
        reply = pipe.recv_bytes()
    except (EOFError, OSError):
        process = pool.processes[rank]
        process.join(1.0)
        message = f"worker process exited (exit code {process.exitcode}) without reporting a result"
        return "error", message, time.time()
    try:
        return pickle.loads(reply)
    except Exception:
        message = "the parent could not unpickle this rank's result:\n" + traceback.format_exc()
        return "error", message, time.time()


def _dump_stacks(pool: _Pool, ranks: list[int]) -> dict[int, str]:
    """Ask each listed worker for its Python stacks (faulthandler on SIGUSR1) and read them back.

    faulthandler writes from inside its C signal handler, so this works even when the
    worker's main thread is blocked inside a gloo collective.
    """
    offsets = {rank: _file_size(pool.stack_files[rank]) for rank in ranks}
    for rank in ranks:
        try:
            os.kill(pool.processes[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < deadline and any(_file_size(pool.stack_files[r]) <= offsets[r] for r in ranks):
        time.sleep(0.02)
    time.sleep(0.05)  # a dump is written in many small pieces; let the last ones land
    stacks = {}
    for rank in ranks:
        dump = ""
        if pool.stack_files[rank].exists():  # absent if the worker never got as far as faulthandler
            with open(pool.stack_files[rank], errors="replace") as file:
                file.seek(offsets[rank])
                dump = _without_lifeline_thread(file.read())
        stacks[rank] = dump or "(no stack dump arrived)"
    return stacks


def _file_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _without_lifeline_thread(stack: str) -> str:
    """Drop the harness's own watchdog thread from a faulthandler dump: it is always there and never the answer."""
    threads = stack.strip().split("\n\n")
    return "\n\n".join(thread for thread in threads if _exit_when_parent_dies.__name__ not in thread)


def _build_error(
    title: str, timeout: float,
    outcomes: dict[int, tuple[str, Any, float]], hung: list[int], stacks: dict[int, str],
) -> DistributedTestError:
    failed = sorted(rank for rank, (status, _, _) in outcomes.items() if status != "ok")
    first_failed = min(failed, key=lambda rank: outcomes[rank][2]) if failed else None
    problems = []
    if failed:
        problems.append(f"rank(s) {failed} raised, rank {first_failed} first")
    if hung:
        reason = "after another rank failed" if failed else f"within the {timeout:g} s timeout (hung)"
        problems.append(f"rank(s) {hung} did not finish {reason}")
    sections = [f"{title}: " + "; ".join(problems)]
    for rank in range(len(outcomes) + len(hung)):
        if rank in hung:
            sections.append(f"----- rank {rank}: did not finish; its Python stack:\n{stacks[rank]}")
        elif rank in failed:
            first = " (first to fail)" if rank == first_failed else ""
            sections.append(f"----- rank {rank}: failed{first}:\n{outcomes[rank][1]}")
        else:
            sections.append(f"----- rank {rank}: finished")
    return DistributedTestError("\n".join(sections), failed, first_failed, hung)


def _discard_pool(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        _kill_pool(pool)


def _kill_pool(pool: _Pool) -> None:
    """SIGKILL every worker's process group (worker + anything it forked) and reap them."""
    for process in pool.processes:
        if process.pid is None:
            continue
        for kill in (lambda: os.killpg(process.pid, signal.SIGKILL), lambda: os.kill(process.pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
    for process in pool.processes:
        process.join(5.0)
    for pipe in pool.task_pipes + pool.lifelines:
        pipe.close()
    shutil.rmtree(pool.workdir, ignore_errors=True)


# ----------------------------------------------------------------------------- worker side


def _worker_main(
    rank: int, world_size: int, master_port: int,
    task_pipe: multiprocessing.connection.Connection,
    lifeline: multiprocessing.connection.Connection, stack_file: str,
) -> None:
    """Join the gloo group once, then run tasks until told to stop (or the parent disappears)."""
    os.setpgid(0, 0)  # own process group, so the parent can kill whatever this worker forks
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    sys.stdout.reconfigure(line_buffering=True)  # prints survive the worker being killed
    threading.Thread(target=_exit_when_parent_dies, args=(lifeline,), daemon=True).start()
    stack_stream = open(stack_file, "w")  # kept open for faulthandler for the worker's life
    faulthandler.register(signal.SIGUSR1, file=stack_stream, all_threads=True)

    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
    )
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", master_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:
        task_pipe.send_bytes(pickle.dumps(("error", traceback.format_exc(), time.time())))
        os._exit(1)
    task_pipe.send_bytes(pickle.dumps(("ok", "ready", time.time())))

    while True:
        try:
            task = task_pipe.recv_bytes()
        except (EOFError, OSError):
            return
        if not task:
            return
        groups_before = set(dist.distributed_c10d._world.pg_map)
        try:
            fn, args, kwargs = pickle.loads(task)
            with logger_state_restored():  # a task's log handlers must not leak into the next task
                reply = ("ok", fn(*args, **kwargs), time.time())
        except BaseException:
            reply = ("error", traceback.format_exc(), time.time())
        status, payload = _encode_reply(reply)
        task_pipe.send_bytes(payload)
        if status != "ok":
            # Peers blocked in a collective with this rank get a connection error now,
            # instead of waiting out the group timeout; the pool is recycled anyway.
            os._exit(1)
        dist.barrier()
        _destroy_groups_created_since(groups_before)


def _encode_reply(reply: tuple[str, Any, float]) -> tuple[str, bytes]:
    try:
        return reply[0], pickle.dumps(reply)
    except Exception:
        message = "the return value could not be pickled:\n" + traceback.format_exc()
        return "error", pickle.dumps(("error", message, reply[2]))


def _destroy_groups_created_since(groups_before: set) -> None:
    """Free subgroups a task created (gloo groups hold sockets and threads); runs after the barrier,
    when no rank can still be using them."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group not in groups_before and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _exit_when_parent_dies(lifeline: multiprocessing.connection.Connection) -> None:
    try:
        while True:
            lifeline.recv_bytes()
    except (EOFError, OSError):
        os._exit(3)
