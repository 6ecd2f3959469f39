"""What ``zerotune plan`` prints and parses, for a DeepSpeed config (``plan.py``) and a recipe (``plan_recipe.py``)
alike: sizes and numbers given on the command line, and one rank's plan table with its verdicts."""

from __future__ import annotations

import re
from typing import Any

from zerotune.config.errors import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, option: str) -> int:
    """``80GiB``, ``512GB``, ``1.5TiB`` or a byte count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", text.lower())
    unit = (match.group(2) or "") if match else None
    if unit is not None and unit and not unit.endswith("b"):
        unit += "b"
    if match is None or unit not in UNITS:
        raise ConfigError(option, f"{text!r} is not a size; write e.g. 80GiB, 512GB or 1.5TiB")
    return int(float(match.group(1)) * UNITS[unit])


def parse_number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(option, f"{text!r} is not a number") from None
    if not value > 0:
        raise ConfigError(option, f"must be > 0, got {text}")
    return value


def gib(value: int) -> str:
    return f"{value / 2**30:,.2f} GiB"


def print_plan(plan: Any, profile: Any, layout: Any, model_name: str, world_size: int, nodes: int, seq_len: int,
               hardware: Any, checkpointing_chosen: bool | None = None) -> int:
    """Print one rank's plan (rows, the device verdicts, host / NVMe totals, modeled step time); the exit
    status: 0 when it fits (with checkpointing, unless that was chosen), else 1."""
    from zerotune.plan.auto import step_seconds
    from zerotune.plan.memory import stage_profiles

    device, host = hardware.device_memory, hardware.host_memory
    where = f", pipeline stage {plan.stage} (the fullest)" if plan.stage is not None else ""
    print(f"{model_name}: {plan.trainable + plan.frozen:,} parameters ({plan.trainable:,} trainable){where}; "
          f"ZeRO {layout.stage}, {layout.precision}, {world_size} ranks (dp {layout.dp} x tp {layout.tp} x pp "
          f"{layout.pp}" + (f" x sp {layout.sp}" if layout.sp > 1 else "") + f"), micro-batch {layout.micro_batch} x "
          f"{seq_len} tokens; offload_optimizer "
          f"{layout.offload_optimizer}, offload_param {layout.offload_param}")
    width = max(len(row.name) for row in plan.rows)
    for row in plan.rows:
        print(f"  {row.name:<{width}}  {gib(row.bytes):>14}  {row.where:<6}  {row.note}")
    fits = True
    for checkpointing in (False, True) if checkpointing_chosen is None else (checkpointing_chosen,):
        total = plan.total("device", checkpointing)
        verdict = "fits" if total <= device else "does NOT fit"
        fits_here = total <= device
        label = "with activation checkpointing" if checkpointing else "without activation checkpointing"
        print(f"  device total {label}: {gib(total)} of {gib(device)}: {verdict}")
        fits = fits_here if checkpointing or checkpointing_chosen is not None else fits
    if host is not None:
        per_node = plan.total("host") * (world_size // nodes)
        print(f"  host memory per node for offload: {gib(per_node)} of {gib(host)}: "
              f"{'fits' if per_node <= host else 'does NOT fit'}")
        fits = fits and per_node <= host
    if plan.total("nvme"):
        print(f"  NVMe space per node: {gib(plan.total('nvme') * (world_size // nodes))}")
    for checkpointing in (False, True) if checkpointing_chosen is None else (checkpointing_chosen,):
        seconds, comm, _ = max(step_seconds(layout, held, layout.gas, checkpointing, hardware)
                               for held in stage_profiles(profile, layout))  # a pipeline's slowest stage
        print(f"  modeled step time {'with' if checkpointing else 'without'} activation checkpointing: "
              f"{seconds * 1e3:.1f} ms ({comm / 2**30:.2f} GiB communicated per rank; --flops {hardware.flops:.3g}, "
              f"--bandwidth {hardware.bandwidth / 1e9:g} GB/s"
              + (f", --intra-node-bandwidth {hardware.intra_node_bandwidth / 1e9:g} GB/s"
                 if layout.tp > 1 or layout.sp > 1 else "")
              + "; gradient reduction hidden under the backward where it fits)")
    return 0 if fits else 1
