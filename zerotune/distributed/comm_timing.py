"""The collective layer's timing hook: where ``comm.run_collective`` hands a call's latency to the comms log.

Kept apart from ``comm.py`` so the log (``comm_log.py``, which itself issues a collective for its straggler
report) can sit above the layer: the log registers itself here with ``set_call_log``, the layer asks
``start`` for each call, and nothing here depends on either. With no log registered, or one that does not
want the op, ``start`` returns None and the call costs one attribute read.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from zerotune.distributed.guard import call_site


class CallLog(Protocol):
    debug: bool

    def wants(self, op: str) -> bool: ...

    def record_call(self, op: str, latency_ms: float, msg_size: int, world: int, caller: str | None) -> None: ...


_log: CallLog | None = None


def set_call_log(log: CallLog | None) -> None:
    """Make ``log`` the process's comms log (None: time nothing)."""
    global _log
    _log = log


def message_bytes(op: str, volume: int, world: int) -> int:
    """DeepSpeed's message size (the tensor handed to the call) from the layer's counted volume: an all-reduce
    counts its tensor twice, an all-gather the whole gathered output, everything else the tensor handed in."""
    if op == "all_reduce":
        return volume // 2
    if op in ("all_gather", "sparse_all_gather"):
        return volume // max(world, 1)
    return volume


def start(op: str, volume: int, world: int) -> Callable[[], None] | None:
    """Start timing a call of ``op`` if the log wants it; returns what to call once the call completed."""
    log = _log
    if log is None or not log.wants(op):
        return None
    caller = call_site() if log.debug else None
    size = message_bytes(op, volume, world)
    started = time.perf_counter()

    def done() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # an NCCL work's wait() returns before the kernel ran: time the device work
        log.record_call(op, (time.perf_counter() - started) * 1000.0, size, world, caller)

    return done
