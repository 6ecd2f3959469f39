"""One engine's guards: its collective guard, its watchdog timeout, its activation-checkpointing policy.

``initialize`` builds them (``EngineGuards.start``) from the engine's config -- ``collective_guard``,
``comm_timeout_s``, the ``activation_checkpointing`` section -- and hands them to the engine, which closes
them in ``destroy()``. Two engines in one process (a GAN, RLHF's policy and reference model) each keep
their own: the guard-on engine compares its ranks' collectives while a guard-off engine's go unrecorded,
each engine's collectives are watched with its own timeout, each model's checkpointed regions follow its
engine's policy.

How a collective finds its engine: the engine's methods run inside its scope (``EngineGuards.method``
decorates them); ``guard_scope.py`` says why a scope and not a process group, and what collectives issued
outside any engine's method (autograd's device threads, the script's own) report to.

Why here and not in ``initialize``: the guards are armed collectively (the guard's own gloo group, every
rank's config compared), which is the distributed layer's business; ``initialize`` passes primitives.
The policy is carried opaquely (``parallel/activation_checkpointing.py`` owns its type and its rules), so
this layer does not import the one above it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.distributed.guard import CollectiveGuard
from zerotune.distributed.guard_scope import GuardScope, enter, leave, make_newest
from zerotune.distributed.mesh import AXES, DERIVED_AXES, ProcessMesh
from zerotune.distributed.watchdog import WATCHDOG

Method = TypeVar("Method", bound=Callable[..., Any])


class EngineGuards(GuardScope):
    """The guards one engine owns (see the module docstring); ``guard`` is inactive when the config turned it off,
    ``timeout_s`` None when ``comm_timeout_s`` is null."""

    @classmethod
    def start(cls, *, collective_guard: bool, comm_timeout_s: float | None, checkpoint_policy: Any, config: dict,
              mesh: ProcessMesh, model: torch.nn.Module, rank: int, stage_local: bool = False) -> EngineGuards:
        """Arm an engine's guards (collectively: every rank calls it, as ``initialize`` does) and make it the newest
        engine. With the guard on, every rank's ``config`` and ``model`` are compared before the first collective
        that depends on them; ``stage_local``: the model holds only this rank's pipeline stage (a
        ``PipelineModule``), so only its data-parallel peers hold the same parameters."""
        guards = cls(CollectiveGuard(), comm_timeout_s, checkpoint_policy)
        if comm_timeout_s is not None:
            WATCHDOG.start(comm_timeout_s, rank=rank)
        make_newest(guards)
        if collective_guard:
            guards.guard.start([mesh.group(axis) for axis in (*AXES, *DERIVED_AXES)], rank=rank,
                               store=_rendezvous_store())
            with guards.entered():
                comm.check_same_setup(config, _signature(model), _model_peers(mesh, rank, stage_local))
        return guards

    @classmethod
    def off(cls) -> EngineGuards:
        """No guard, no watchdog, the process's checkpointing policy: an engine built without ``initialize``."""
        return cls(CollectiveGuard())

    def entered(self) -> _Entered:
        """``with guards.entered():`` -- collectives issued in the block report to these guards."""
        return _Entered(self)

    def close(self) -> None:
        """The engine is destroyed: settle its last guard exchange, stop its guard, stop watching its collectives."""
        with self.entered():
            comm.settle_guard()
        self.guard.stop()
        self.timeout_s = None

    @staticmethod
    def method(function: Method) -> Method:
        """Decorate an engine method: it runs inside its engine's guards (``self.guards``)."""
        @functools.wraps(function)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = enter(self.guards)
            try:
                return function(self, *args, **kwargs)
            finally:
                leave(token)

        return run  # type: ignore[return-value]


class _Entered:
    def __init__(self, scope: GuardScope) -> None:
        self.scope = scope
        self.token: Any = None

    def __enter__(self) -> GuardScope:
        self.token = enter(self.scope)
        return self.scope

    def __exit__(self, *exc: object) -> None:
        leave(self.token)


def _signature(model: torch.nn.Module) -> list[str]:
    return [f"{name} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}" for name, p in model.named_parameters()]


def _model_peers(mesh: ProcessMesh, rank: int, stage_local: bool) -> tuple[int, ...]:
    if stage_local:  # a stage's ranks hold the same layers
        dp_sp = mesh.group("dp_sp")
        return tuple(dist.get_process_group_ranks(dp_sp)) if dp_sp is not None else (rank,)
    return tuple(range(dist.get_world_size()))


def _rendezvous_store() -> dist.Store | None:
    """The default group's store (stalled ranks compare notes there); None where torch hides it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: without it, stalls wait for the watchdog
        return None
