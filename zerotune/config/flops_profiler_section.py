"""DeepSpeed's ``flops_profiler`` block: profile one training step's forward and print it on rank 0.

The engine (``zerotune/engine_flops.py``) runs ``zerotune.profiling.FlopsProfiler`` over the forwards of global
step ``profile_step`` and prints (or writes to ``output_file``) the profile when that step's optimizer step is
taken, as DeepSpeed does. Key names and defaults are DeepSpeed's (``deepspeed/profiling/constants.py``).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Optional

from pydantic import Field, StrictBool

from .section import NoEffect, Section
from .types import Fraction, Int, NonNegInt, PosInt, Str


class FlopsProfilerConfig(Section):
    """``flops_profiler``: DeepSpeed's flops profiler, run by the engine at one step."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        # DeepSpeed's own flops-profiler unit test sets it; DeepSpeed's config reads only the keys below
        "step": (None, "", "DeepSpeed does not read it either (the step profiled is profile_step)"),
    }

    enabled: StrictBool = False
    """Profile the forward of step ``profile_step`` on rank 0 and print the profile."""
    recompute_fwd_factor: Fraction = 0.0
    """The share of the forward that activation checkpointing runs again in the backward (0 to 1): the
    backward's FLOPS lines, printed with ``wall_clock_breakdown``, count (2 + this) x the forward's flops."""
    profile_step: NonNegInt = 1
    """The global step (optimizer steps taken before it) whose forward is profiled; 0 is the first."""
    module_depth: Annotated[Int, Field(ge=-1)] = -1
    """How deep the aggregated profile goes into the module tree; -1: down to the innermost modules."""
    top_modules: PosInt = 1
    """How many module types the aggregated profile lists per depth."""
    detailed: StrictBool = True
    """Also print the model tree with each module's figures."""
    output_file: Optional[Str] = None
    """Write the profile to this file (its directory created) instead of standard output."""


__all__ = ["FlopsProfilerConfig"]
