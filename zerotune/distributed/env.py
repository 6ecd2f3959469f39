"""Who am I, how many of us, and on which device: the process-level distributed environment.

zerotune never manages processes itself. Launchers (torchrun, SLURM's srun, OpenMPI's mpirun)
start the ranks; this module reads what they put in the environment, picks the device and the
backend (NCCL with CUDA, gloo otherwise) and initializes torch.distributed once.

A script started with plain ``python`` is a world of one: it still gets a real (single-member)
process group, so world size 1 runs exactly the same code as world size 64.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist

from zerotune.distributed.launcher_link import bind_to_launcher

DEFAULT_PORT = 29500


class DistributedSetupError(RuntimeError):
    """The launcher's environment is incomplete or contradictory."""


def _default_timeout() -> timedelta:
    """Collective timeout: ``ZEROTUNE_DIST_TIMEOUT_S`` seconds, 30 minutes by default (as torch)."""
    value = os.environ.get("ZEROTUNE_DIST_TIMEOUT_S", "1800")
    try:
        seconds = float(value)
    except ValueError:
        raise DistributedSetupError(f"ZEROTUNE_DIST_TIMEOUT_S={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise DistributedSetupError(f"ZEROTUNE_DIST_TIMEOUT_S={value!r} must be positive")
    return timedelta(seconds=seconds)


DEFAULT_TIMEOUT = _default_timeout()
EXIT_GRACE_S = 10.0
"""How long a clean exit waits for the process group to come down before leaving it to finalization."""


@dataclass(frozen=True)
class DistEnv:
    """The facts about this process that every component needs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host name of a SLURM node list: ``node[03-05,9],gpu1`` -> ``node03``,
    ``rack[1-2]-n[01-04]`` -> ``rack1-n01``."""
    first, depth = "", 0
    for char in nodelist.strip():  # the first top-level comma ends the first host expression
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            break
        first += char
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)
    if not first or first.startswith("[") or depth != 0 or not host:
        raise DistributedSetupError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    return host


def _launcher_ranks() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun, SLURM or OpenMPI variables, or None."""
    for rank_var, world_var, local_var in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        rank, world = _int_env(rank_var), _int_env(world_var)
        if rank is None and world is None:
            continue
        if rank is None or world is None:
            missing = rank_var if rank is None else world_var
            raise DistributedSetupError(f"{missing} is not set although its launcher's other variables are")
        if not 0 <= rank < world:
            raise DistributedSetupError(f"{rank_var}={rank} is outside [0, {world_var}={world})")
        local = _int_env(local_var)
        return rank, world, rank if local is None else local
    return None


def _ensure_rendezvous_address() -> None:
    """MASTER_ADDR/PORT for launchers that do not set them (SLURM) -- torchrun always does."""
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise DistributedSetupError(
                "MASTER_ADDR is not set: export it (the address of rank 0) or launch with torchrun"
            )
        os.environ["MASTER_ADDR"] = first_slurm_host(nodelist)
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))


def _pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


class _ExitRelease:
    """Tear down the process group ``init_distributed`` made when the interpreter exits normally.

    DeepSpeed scripts rarely call ``destroy_process_group``; under torch 2.13 a gloo group left to
    interpreter finalization now and then aborts a process that finished its work ("terminate called
    without an active exception", exit -6), and torchrun reports the job failed (a plain torch script
    does it too). ``test_a_clean_exit_tears_the_process_group_down...`` checks the teardown. Tearing
    down waits for the group's in-flight work, so it is skipped after an uncaught exception (a peer may
    still wait in a collective with this rank: the failure must end the process now, not when the peer
    gives up) and bounded by ``EXIT_GRACE_S`` otherwise.
    """

    def __init__(self) -> None:
        self.armed = False
        self.failed = False

    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        previous = sys.excepthook

        def note_failure(kind: type[BaseException], value: BaseException,
                         traceback: TracebackType | None) -> None:
            self.failed = True
            previous(kind, value, traceback)

        sys.excepthook = note_failure
        atexit.register(self.release)

    def release(self) -> None:
        if self.failed or not dist.is_initialized():
            return
        teardown = threading.Thread(target=dist.destroy_process_group, name="zerotune-exit", daemon=True)
        teardown.start()
        teardown.join(EXIT_GRACE_S)


_EXIT_RELEASE = _ExitRelease()


def current_env() -> DistEnv:
    """The environment of an already initialized process group."""
    if not dist.is_initialized():
        raise DistributedSetupError("torch.distributed is not initialized: call zerotune.init_distributed() first")
    local_rank = next((value for value in map(_int_env, ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"))
                       if value is not None), 0)
    backend = dist.get_backend()
    device = _pick_device(local_rank) if backend == "nccl" else torch.device("cpu")
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def _attempt_store(world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's agent keeps one store for every attempt of an elastic job; after a restart, the new ranks
    could read the addresses the dead attempt's ranks published there and fail to connect (a race seen on
    every few restarts). Keys under a prefix naming the attempt keep each attempt's rendezvous its own."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"zerotune/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> DistEnv:
    """Initialize torch.distributed from the launcher's environment (DeepSpeed's signature).

    Reuses an existing default process group. With no launcher variables at all, starts a
    world of one in-process (no ports, no launcher). ``timeout`` bounds every collective, so a
    dead rank turns into an error instead of a silent hang.
    """
    del auto_mpi_discovery, verbose, config  # accepted for DeepSpeed compatibility
    bind_to_launcher()
    if dist.is_initialized():
        return current_env()
    if dist_init_required is False:
        raise DistributedSetupError("dist_init_required=False but torch.distributed is not initialized")
    launched: tuple[int, int, int] | None
    if rank >= 0 and world_size > 0:
        if rank >= world_size:
            raise DistributedSetupError(f"rank={rank} is outside [0, world_size={world_size})")
        launched = (rank, world_size, _int_env("LOCAL_RANK") or 0)
    else:
        launched = _launcher_ranks()
    if launched is None:
        backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device = _pick_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        _EXIT_RELEASE.arm()
        return DistEnv(0, 1, 0, device, backend)
    rank, world_size, local_rank = launched
    device = _pick_device(local_rank)
    backend = dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    if init_method is None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        _ensure_rendezvous_address()
        init_method = "env://"
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", local_rank)):
        os.environ.setdefault(name, str(value))
    store = None
    if init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store, init_method = _attempt_store(world_size, timeout), None  # the agent's store replaces env://
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    _EXIT_RELEASE.arm()
    return DistEnv(rank, world_size, local_rank, device, backend)
