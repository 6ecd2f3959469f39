"""DeepSpeed's ``comms_logger`` block: time collectives by op and message size (``zerotune/distributed/comm_log.py``).

Calls and bytes of every collective are counted regardless (``zerotune.comm.comm_stats()``); this block switches
on the per-call latency log that ``deepspeed.comm.log_summary()`` prints. The engine applies an enabled block to
the process's log when it is built, as DeepSpeed's engine does (a disabled block leaves the log as it is, so a
second engine without the block does not switch off the first one's profiling). Keys and defaults are DeepSpeed's
(``deepspeed/comm/constants.py``).
"""

from __future__ import annotations

from pydantic import Field, StrictBool

from .section import Section
from .types import Str


class CommsLoggerConfig(Section):
    """``comms_logger``: the collectives' latency log."""

    enabled: StrictBool = False
    """Time the collectives chosen by ``prof_all`` / ``prof_ops`` (each timed call waits for its completion)."""
    verbose: StrictBool = False
    """Log every timed call on rank 0 (op, latency, message size, bandwidths)."""
    prof_all: StrictBool = True
    """Time every op; false: only those named in ``prof_ops``."""
    debug: StrictBool = False
    """Record each call under its op name and calling site, apart from other sites' calls."""
    prof_ops: list[Str] = Field(default_factory=list)
    """Ops timed when ``prof_all`` is false, by zerotune's or DeepSpeed's name (``all_reduce``,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ...)."""


__all__ = ["CommsLoggerConfig"]
