"""DeepSpeed's flops profiler API (``deepspeed.profiling.flops_profiler``) on torch's ``FlopCounterMode``.

``FlopsProfiler(model)`` measures the forward passes run between ``start_profile()`` and ``stop_profile()``:
per module the MACs, floating-point operations, latency and parameters (``counting.py`` says what is counted),
and ``print_model_profile`` prints them as DeepSpeed does (``report.py``). The engine runs one at the config's
``flops_profiler.profile_step`` (``zerotune/engine_flops.py``); ``get_model_profile`` profiles one forward (or
``generate``) of a model outside training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Iterator, Optional, TextIO

import torch

from zerotune.profiling.counting import ForwardCounts, module_params
from zerotune.profiling.formatting import (
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from zerotune.profiling.report import Breakdown, write_aggregated, write_detailed, write_summary

logger = logging.getLogger("zerotune")


@contextlib.contextmanager
def _output(output_file: Optional[str]) -> Iterator[TextIO]:
    """Standard output, or ``output_file`` (its directory created) written afresh."""
    if not output_file:
        yield sys.stdout
        return
    directory = os.path.dirname(os.path.abspath(output_file))
    try:
        os.makedirs(directory, exist_ok=True)
        with open(output_file, "w") as out:
            yield out
    except OSError as err:
        raise OSError(f"flops profiler: cannot write the profile to output_file {output_file!r}: {err}") from err


class FlopsProfiler:
    """Measures the latency, estimated floating-point operations, MACs and parameters of each module of ``model``
    over the forwards run while it is started.

    ``ds_engine`` (the training engine, when the engine runs the profiler) adds its world, data- and
    model-parallel sizes and micro batch to the printed summary; ``recompute_fwd_factor`` is the share of the
    forward that activation checkpointing runs again in the backward (0 to 1), which the backward's FLOPS lines
    of a wall-clock breakdown count. After ``print_model_profile`` the totals are in ``flops``, ``macs`` and
    ``params`` (what DeepSpeed's ``engine.flops_profiler`` exposes)."""

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.flops = 0
        self.macs = 0
        self.params = 0
        self._counts = ForwardCounts(model)

    # ---- the profiling window ------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Optional[list[type]] = None) -> None:
        """Reset the figures and measure the forwards from now on; modules of the types in ``ignore_list`` get no
        figures of their own (their parents' include them)."""
        logger.info("Flops profiler started")
        self._counts = ForwardCounts(self.model, ignore=tuple(ignore_list or ()))
        self._counts.start()
        self.started = True

    def stop_profile(self) -> None:
        """Stop measuring; the figures stay readable (and printable) until ``end_profile``."""
        self._counts.stop()

    def reset_profile(self) -> None:
        """Clear the figures; a started profile goes on measuring from zero."""
        running = self._counts.running
        self._counts.stop()
        self._counts = ForwardCounts(self.model, ignore=self._counts.ignore)
        if running:
            self._counts.start()

    def end_profile(self) -> None:
        """Stop measuring and drop the figures."""
        if not self.started:
            return
        self._counts.stop()
        self._counts = ForwardCounts(self.model)
        self.started = False
        logger.info("Flops profiler finished")

    # ---- totals -------------------------------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Floating-point operations of the measured forwards."""
        flops = self._counts.flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulate operations of the measured forwards."""
        macs = self._counts.macs(self.model)
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds the measured forwards took (as the model's forward hooks saw them)."""
        duration = self._counts.duration(self.model)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """The model's parameters on this rank."""
        params = module_params(self.model)
        return params_to_string(params) if as_string else params

    # ---- printing -----------------------------------------------------------------------------------------
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None) -> None:
        """Print the profile (to ``output_file`` when given): the summary, the top ``top_modules`` module types
        per depth down to ``module_depth`` (-1: all), and with ``detailed`` the model tree with each module's
        figures. Does nothing unless started, as DeepSpeed's."""
        if not self.started:
            return
        self.flops = int(self.get_total_flops())
        self.macs = int(self.get_total_macs())
        self.params = int(self.get_total_params())
        breakdown = self._breakdown()
        with _output(output_file) as out:
            write_summary(out, self._counts, profile_step, self.ds_engine, self.recompute_fwd_factor, breakdown)
            print("\n----------------------------- Aggregated Profile per GPU -----------------------------", file=out)
            write_aggregated(out, self._counts, module_depth=module_depth, top_modules=top_modules)
            if detailed:
                write_detailed(out, self._counts)
            print("------------------------------------------------------------------------------", file=out)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the top ``top_modules`` module types by parameters, MACs and latency at each depth."""
        write_aggregated(sys.stdout, self._counts, module_depth=module_depth, top_modules=top_modules)

    def _breakdown(self) -> Optional[Breakdown]:
        """The engine's wall-clock phases of the profiled step, when its ``wall_clock_breakdown`` is on."""
        engine = self.ds_engine
        if engine is None or not engine.wall_clock_breakdown():
            return None
        latencies = getattr(engine, "flops_profile_breakdown", None)
        return latencies() if callable(latencies) else None


def _run(model: torch.nn.Module, args: list, kwargs: dict, mode: str) -> None:
    if mode == "forward":
        model(*args, **kwargs)
    elif mode == "generate":
        model.generate(*args, **kwargs)  # type: ignore[operator]
    else:
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")


def get_model_profile(model: torch.nn.Module, input_shape: Optional[tuple] = None, args: Optional[list] = None,
                      kwargs: Optional[dict] = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: Optional[str] = None, ignore_modules: Optional[list[type]] = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward (``mode="generate"``: one ``generate``) of ``model`` in eval mode after ``warm_up``
    unmeasured runs; returns ``(flops, macs, params)``, as strings when ``as_string``.

    The input is ``input_shape`` (one uninitialized tensor of the model's dtype and device, as DeepSpeed builds
    it) or ``args`` / ``kwargs``. The runs go without autograd (their outputs are dropped; the counts are the
    same), which DeepSpeed's leaves on."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        args = [torch.empty(input_shape, dtype=first.dtype if first is not None else None,
                            device=first.device if first is not None else None)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    model.eval()
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            _run(model, args, kwargs, mode)
        profiler.start_profile(ignore_list=ignore_modules)
        try:
            _run(model, args, kwargs, mode)
        finally:
            profiler.stop_profile()
    counts = profiler._counts
    flops, macs, params = counts.flops(model), counts.macs(model), module_params(model)
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params


__all__ = ["FlopsProfiler", "get_model_profile"]
