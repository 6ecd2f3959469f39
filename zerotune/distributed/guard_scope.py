"""Which engine a collective (or a checkpointed region) belongs to, when the process runs several engines.

Each engine owns its guards (``engine_guards.py``): its collective guard, its watchdog timeout and its
activation-checkpointing policy. Two engines in one process (a GAN's generator and discriminator, RLHF's
policy and reference model) must not share them. The process group cannot tell them apart: an engine's mesh
reuses the default group wherever an axis spans the whole world (``torch.distributed.init_device_mesh`` does,
and ``_broadcast_from_rank0`` and ``comm.barrier()`` use it outright), so two engines issue collectives on the
very same groups. What tells them apart is *who is running*: an engine's methods run inside its scope
(``EngineGuards.method``), a context variable, and ``current_scope()`` answers, in order:

1. the engine whose method is running on this thread (the innermost, when one engine calls another);
2. else the engine that ran most recently -- or was built most recently, if it has not run yet. This covers
   the hooks that autograd runs on its own device threads during an engine's ``backward`` (a context variable
   does not follow them there), and a script's collectives between engine calls (``zerotune.comm``, or its own
   ``torch.distributed`` calls under ``guard_torch_distributed()``): with one engine they report to it, as
   before; with several, to the engine the script called last, which every rank agrees on because every
   rank runs the same script;
3. else (no engine built yet) the process default, ``PROCESS_SCOPE``: ``guard.GUARD``, no watchdog timeout.

Why not a global "current engine" set by ``initialize`` alone: the latest engine would then own every
collective, the earlier engines' guards would see none of theirs. Why not one process group per engine:
a second communicator per engine costs NCCL memory and setup, and the default group would still be shared.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar
from typing import Any

from zerotune.distributed.guard import GUARD, CollectiveGuard

_SERIALS = itertools.count(1)


def next_serial() -> int:
    """A number that grows with every call in this process: orders engines against direct ``configure()`` calls
    of ``deepspeed.checkpointing`` (``activation_checkpointing.policy_in_force``)."""
    return next(_SERIALS)


class GuardScope:
    """What collectives and checkpointed regions issued on one engine's behalf report to.

    ``guard``: its collective guard (inactive when ``collective_guard`` is false); ``timeout_s``: how long its
    collectives may stay pending before the watchdog ends the process (None: not watched); ``checkpoint_policy``:
    its ``activation_checkpointing`` policy (a ``CheckpointPolicy``; None: the process's); ``serial``: when it was
    built, against ``next_serial()``."""

    def __init__(self, guard: CollectiveGuard, timeout_s: float | None = None, checkpoint_policy: Any = None) -> None:
        self.guard = guard
        self.timeout_s = timeout_s
        self.checkpoint_policy = checkpoint_policy
        self.serial = next_serial()


PROCESS_SCOPE = GuardScope(GUARD)
"""Before any engine is built: the process default guard (off unless armed directly), no watchdog."""

_running: ContextVar[GuardScope | None] = ContextVar("zerotune_running_engine", default=None)
_newest: GuardScope | None = None


def current_scope() -> GuardScope:
    """The scope a collective issued now belongs to (the module docstring's order)."""
    return _running.get() or _newest or PROCESS_SCOPE


def engine_scope() -> GuardScope | None:
    """The running engine's scope, else the newest engine's; None before any engine was built."""
    return _running.get() or _newest


def make_newest(scope: GuardScope) -> None:
    """``scope``'s engine ran (or was built) last: outside any engine's method, collectives report to it."""
    global _newest
    _newest = scope


def enter(scope: GuardScope) -> object:
    """Start running ``scope``'s engine on this thread; returns the token ``leave`` takes."""
    global _newest
    _newest = scope
    return _running.set(scope)


def leave(token: Any) -> None:
    """Undo the matching ``enter`` (the engine it entered stays the newest)."""
    _running.reset(token)
