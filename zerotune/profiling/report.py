"""The text of a flops profile, laid out as DeepSpeed's ``print_model_profile`` prints it.

Three parts: the summary (the engine's parallel sizes when there is one, parameters, forward MACs / flops /
latency and, with the engine's wall-clock breakdown, the backward and step latencies and throughputs); the
aggregated profile (per depth of the module tree, the top module types by parameters, MACs and latency); and the
detailed profile (the model's own ``repr`` with each module's figures in front of its arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, TextIO

import torch

from zerotune.profiling.counting import ForwardCounts, module_params
from zerotune.profiling.formatting import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

_LINE = "{:<70}  {:<8}"
_NOTATIONS = ("Notations:\n"
              "data parallel size (dp_size), model parallel size(mp_size),\n"
              "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
              "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
              "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
              "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n")
_DETAILED_NOTE = (
    "Each module profile is listed after its name in the following order: \nparams, percentage of total params, "
    "MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS\n\n"
    "Note: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). "
    "They are not counted as submodules, thus not to be printed out. However they make up the difference between "
    "a parent's MACs (or latency) and the sum of its submodules'.\n2. Number of floating-point operations is a "
    "theoretical estimation, thus FLOPS computed using that could be larger than the maximum system throughput.\n"
    "3. The fwd latency listed in the top module's profile is directly captured at the module forward function in "
    "PyTorch, thus it's less than the fwd latency shown above which is captured in the engine.\n")


@dataclass(frozen=True)
class Breakdown:
    """The profiled step's wall-clock phases in seconds (the engine's ``wall_clock_breakdown`` timers)."""

    forward: float
    backward: float
    step: float


def _percent(part: float, whole: float) -> float:
    return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds if seconds else 0)


def write_summary(out: TextIO, counts: ForwardCounts, profile_step: int, engine: Any, recompute_fwd_factor: float,
                  breakdown: Optional[Breakdown]) -> None:
    """The summary block: sizes, totals and (with a breakdown) the backward / step figures."""
    def line(label: str, value: Any) -> None:
        print(_LINE.format(label, value), file=out)

    model = counts.model
    flops, macs, params = counts.flops(model), counts.macs(model), module_params(model)
    mp_size = getattr(engine, "mp_world_size", 1) if engine is not None else 1
    print("\n-------------------------- DeepSpeed Flops Profiler --------------------------", file=out)
    print(f"Profile Summary at step {profile_step}:", file=out)
    print(_NOTATIONS, file=out)
    if engine is not None:
        line("world size: ", engine.world_size)
        # under Ulysses sequence parallelism DeepSpeed's dp_world_size is None: the replication is the
        # sequence-data-parallel group's
        dp_size = engine.dp_world_size
        line("data parallel size: ", dp_size if dp_size is not None else getattr(engine, "seq_dp_world_size", None))
        line("model parallel size: ", mp_size)
        line("batch size per GPU: ", engine.train_micro_batch_size_per_gpu())
    line("params per GPU: ", params_to_string(params))
    line("params of model = params per GPU * mp_size: ", params_to_string(params * mp_size if engine else 0))
    line("fwd MACs per GPU: ", macs_to_string(macs))
    line("fwd flops per GPU: ", number_to_string(flops))
    line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp_size))
    forward = breakdown.forward if breakdown is not None else counts.duration(model)
    line("fwd latency: ", duration_to_string(forward))
    line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _rate(flops, forward))
    if breakdown is None:
        return
    factor = 2 + recompute_fwd_factor  # a backward costs twice the forward, plus any recomputed forward
    line("bwd latency: ", duration_to_string(breakdown.backward))
    line(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
         _rate(factor * flops, breakdown.backward))
    line(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
         _rate((factor + 1) * flops, forward + breakdown.backward))
    line("step latency: ", duration_to_string(breakdown.step))
    iteration = forward + breakdown.backward + breakdown.step
    line("iter latency: ", duration_to_string(iteration))
    line(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ", _rate((factor + 1) * flops, iteration))
    if engine is not None:
        samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
        line("samples/second: ", round(samples / iteration, DEFAULT_PRECISION) if iteration else 0)


def write_aggregated(out: TextIO, counts: ForwardCounts, module_depth: int = -1, top_modules: int = 1) -> None:
    """Per depth of the module tree, the ``top_modules`` module types with the most parameters, MACs and latency
    (the figures of a type's modules at that depth summed); depth -1 goes down to the innermost modules' parents,
    as DeepSpeed's does."""
    info: dict[int, dict[str, list[float]]] = {}

    def walk(module: torch.nn.Module, depth: int) -> None:
        entry = info.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        entry[0] += counts.macs(module)
        entry[1] += module_params(module)
        entry[2] += counts.duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(counts.model, 0)
    depth = len(info) - 1 if module_depth == -1 else module_depth
    print(f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:", file=out)
    def top(types: dict[str, list[float]], column: int, fmt: Callable[[Any], str]) -> dict[str, str]:
        ranked = sorted(types.items(), key=lambda item: item[1][column], reverse=True)[:top_modules]
        return {name: fmt(values[column]) for name, values in ranked}

    for d in range(min(depth, len(info))):
        print(f"depth {d}:", file=out)
        print(f"    params      - {top(info[d], 1, params_to_string)}", file=out)
        print(f"    MACs        - {top(info[d], 0, macs_to_string)}", file=out)
        print(f"    fwd latency - {top(info[d], 2, duration_to_string)}", file=out)


def write_detailed(out: TextIO, counts: ForwardCounts) -> None:
    """The model's ``repr`` with each module's params, MACs, latency (each with its share) and FLOPS in front of
    its own arguments: each module's ``extra_repr`` is swapped for the duration of the print."""
    model = counts.model
    total_params, total_macs, total_time = module_params(model), counts.macs(model), counts.duration(model)

    def figures(module: torch.nn.Module, original: Callable[[], str]) -> Callable[[], str]:
        def extra_repr() -> str:
            params, macs, seconds = module_params(module), counts.macs(module), counts.duration(module)
            items = [f"{params_to_string(params)} = {_percent(params, total_params):g}% Params",
                     f"{macs_to_string(macs)} = {_percent(macs, total_macs):g}% MACs",
                     f"{duration_to_string(seconds)} = {_percent(seconds, total_time):g}% latency",
                     flops_to_string(round(counts.flops(module) / seconds, DEFAULT_PRECISION) if seconds else 0)]
            own = original()
            return ", ".join(items + ([own] if own else []))
        return extra_repr

    swapped = []
    try:
        for module in model.modules():
            if "extra_repr" not in module.__dict__:
                module.extra_repr = figures(module, module.extra_repr)  # type: ignore[method-assign]
                swapped.append(module)
        print("\n------------------------------ Detailed Profile per GPU ------------------------------", file=out)
        print(_DETAILED_NOTE, file=out)
        print(model, file=out)
    finally:
        for module in swapped:
            del module.extra_repr


__all__ = ["Breakdown", "write_summary", "write_aggregated", "write_detailed"]
