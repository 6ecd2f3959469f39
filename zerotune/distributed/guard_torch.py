"""Bring a script's own ``torch.distributed`` collectives under the collective guard and the watchdog (opt-in).

zerotune's collectives pass through ``comm.run_collective``: each is recorded for the guard and known to the
watchdog while it waits. A script's own ``torch.distributed.all_reduce`` (a loss averaged for logging, a
metric gathered for evaluation) is not: a rank that skips one leaves its peer waiting there, unseen, while it
waits at the next guard point -- only the watchdog ends that, after ``comm_timeout_s`` (600 s by default).

``guard_torch_distributed()`` replaces the collectives in the ``torch.distributed`` namespace by wrappers that
issue them through ``comm.run_collective``: recorded with the script's call site, compared at the guard
points, and -- when ranks end up waiting for each other -- settled by the stalled ranks' notes in seconds
(``guard_stall.py``) with ``CollectiveMismatch`` naming where each rank waits. Called plainly it lasts until
``restore()``; as a context manager, until the block ends. Opt-in because it replaces module attributes of
torch, which importing zerotune never does.

What it covers: calls through the namespace (``dist.all_reduce(...)``, ``torch.distributed.barrier()``), from
code outside zerotune (zerotune's own calls are already recorded, and pass straight through). Not covered:
functions imported by name before the call (``from torch.distributed import all_reduce``), point-to-point
``send`` / ``recv``, and torch's internals. An ``async_op=True`` call returns zerotune's handle (``wait()``,
``is_completed()``) instead of torch's ``Work``. Each call counts in ``comm.comm_stats()`` under
``torch.distributed.<name>``, apart from zerotune's own traffic, as the bytes of the tensor(s) named below.

Which engine's guard (and watchdog timeout) a call reports to, with several engines in one process: the engine
whose method is running (a call inside a model's forward), else the engine the script called last (a loss
averaged after ``engine.step()`` reports to that engine) -- ``guard_scope.py``. Every rank runs the same
script, so every rank attributes the call alike; an engine with ``collective_guard: false`` records nothing.
"""

from __future__ import annotations

import functools
import inspect
import sys
from types import TracebackType
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerotune.distributed.comm import run_collective

COUNTED: dict[str, tuple[str | None, int]] = {
    "all_reduce": ("tensor", 2), "broadcast": ("tensor", 1), "reduce": ("tensor", 1),
    "all_gather": ("tensor_list", 1), "all_gather_into_tensor": ("output_tensor", 1),
    "all_gather_single": ("output_tensor", 1), "reduce_scatter": ("input_list", 1),
    "reduce_scatter_tensor": ("input", 1), "reduce_scatter_single": ("input", 1), "all_to_all_single": ("input", 1),
    "all_to_all": ("input_tensor_list", 1), "gather": ("tensor", 1), "scatter": ("tensor", 1),
    "barrier": (None, 0), "all_gather_object": (None, 0), "broadcast_object_list": (None, 0),
    "gather_object": (None, 0), "scatter_object_list": (None, 0),
}
"""Each wrapped collective: the argument whose bytes it counts and a factor (comm.py's convention: an all-reduce
moves its tensor twice), or None for barriers and object collectives (counted as 0 bytes)."""

_originals: dict[str, Callable[..., Any]] = {}


class TorchDistributedGuard:
    """The wrapped state of ``torch.distributed``; ``restore()`` (or leaving the ``with`` block) puts torch's
    functions back. Only the call that wrapped them restores: a nested one leaves them wrapped."""

    def __init__(self, owner: bool) -> None:
        self.owner = owner

    def restore(self) -> None:
        if self.owner:
            for name, original in _originals.items():
                setattr(dist, name, original)
            _originals.clear()
            self.owner = False

    def __enter__(self) -> TorchDistributedGuard:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.restore()


def guard_torch_distributed() -> TorchDistributedGuard:
    """Issue the script's own ``torch.distributed`` collectives through zerotune's collective layer (see the
    module docstring); effective on the guard once ``initialize`` armed it (``collective_guard``, default on)."""
    if _originals:
        return TorchDistributedGuard(owner=False)
    for name, (counted, factor) in COUNTED.items():
        original = getattr(dist, name, None)
        if original is not None:
            _originals[name] = original
            setattr(dist, name, _wrap(name, original, counted, factor))
    return TorchDistributedGuard(owner=True)


def _wrap(name: str, original: Callable[..., Any], counted: str | None, factor: int) -> Callable[..., Any]:
    signature = inspect.signature(original)
    op = f"torch.distributed.{name}"

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_globals.get("__name__", "").startswith("zerotune."):
            return original(*args, **kwargs)  # zerotune's own collective layer: already recorded
        bound = signature.bind(*args, **kwargs).arguments
        group = bound.get("group")
        group = dist.group.WORLD if group is None else group
        async_op = bool(bound.get("async_op", False))
        tensors = _tensors(bound.get(counted)) if counted else []
        handle = run_collective(op, group, factor * sum(t.numel() * t.element_size() for t in tensors),
                                lambda: original(*args, **kwargs), async_op, tensors[0].dtype if tensors else None)
        return handle if async_op else None

    return guarded


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []
