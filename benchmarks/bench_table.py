"""The results table the ZeRO benchmarks print: medians across ranks, ratios to DDP, comm vs theory.

Shared by ``bench_zero12.py`` and ``bench_zero3.py``; each rank's measurements come in as dicts
(``step_s``, ``state_bytes``, ``comm_bytes``, ``comm_ops``, ``breakdown``) and a method that did not
run as a reason string.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable


def theoretical_fraction(method: str, world: int) -> float:
    """Model state x DDP for fp32 + Adam: params 4, grads 4, Adam moments 8 bytes per element (no
    separate master copy in fp32); stage 1 shards the 8, stage 2 the 4 + 8, FSDP2 and stage 3 all 16."""
    sharded = {"ddp": 0, "stage0": 0, "zero_optimizer_ddp": 8, "stage1": 8, "stage2": 12, "fsdp2": 16,
               "fsdp2_reshard": 16, "stage3": 16}[method]
    return (16 - sharded + sharded / world) / 16


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


Column = tuple[str, int, Callable[[str], str]]  # header, width, the cell's text for a method that ran


@dataclass
class Summary:
    """Each method's figures across ranks: why it did not run, or its median step time (slowest
    rank per step) and model-state bytes (largest rank), with ratios to DDP's."""

    reasons: dict[str, str | None]
    running: list[str]
    step_s: dict[str, float]
    state: dict[str, int]
    measured: dict[str, dict]  # rank 0's _measure_step result

    def time_x_ddp(self, method: str) -> float:
        return self.step_s[method] / self.step_s["ddp"] if "ddp" in self.step_s else float("nan")

    def state_x_ddp(self, method: str) -> float:
        return self.state[method] / self.state["ddp"] if "ddp" in self.state else float("nan")


def summarize(per_rank: list[dict], args: argparse.Namespace) -> Summary:
    reasons = per_rank[0]["reasons"]
    running = [m for m in args.methods if reasons[m] is None]
    # The slowest rank sets each step's time; compare medians of interleaved steps.
    step_s = {m: statistics.median(max(r["times"][m][i] for r in per_rank) for i in range(args.steps))
              for m in running}
    state = {m: max(r["measured"][m]["model_state_bytes"] for r in per_rank) for m in running}
    return Summary(reasons, running, step_s, state, {m: per_rank[0]["measured"][m] for m in running})


def time_and_state_columns(summary: Summary, world: int) -> list[Column]:
    """Step time and model state, each x DDP, and theory's model state x DDP."""
    return [("ms/step", 8, lambda m: f"{summary.step_s[m] * 1e3:.1f}"),
            ("x DDP", 6, lambda m: f"{summary.time_x_ddp(m):.3f}"),
            ("state MiB/rank", 14, lambda m: _mib(summary.state[m])),
            ("x DDP", 6, lambda m: f"{summary.state_x_ddp(m):.3f}"),
            ("theory", 6, lambda m: f"{theoretical_fraction(m, world):.3f}")]


def comm_columns(summary: Summary, ideal_bytes: Callable[[str], int], label: str) -> list[Column]:
    """zerotune's bytes per optimizer step and their ratio to ``ideal_bytes(method)``; '-' for torch methods."""
    def volume(method: str) -> int | None:
        return summary.measured[method]["comm_bytes"]
    return [("comm MiB/step", 13, lambda m: _mib(volume(m)) if volume(m) is not None else "-"),
            (label, 6, lambda m: f"{volume(m) / ideal_bytes(m):.3f}" if volume(m) is not None else "-")]


def print_table(methods: Iterable[str], reasons: dict[str, str | None], columns: list[Column]) -> None:
    """One row per method: its cells, or why it did not run."""
    header = " ".join([f"{'method':<19}"] + [f"{title:>{width}}" for title, width, _ in columns])
    print(header)
    print("-" * len(header))
    for method in methods:
        cells = [reasons[method]] if reasons[method] is not None else [
            f"{cell(method):>{width}}" for _, width, cell in columns]
        print(" ".join([f"{method:<19}"] + cells))


def print_details(summary: Summary) -> None:
    """Rank 0's engine memory breakdown and per-op communication, where a method reports them."""
    for method in summary.running:
        measured = summary.measured[method]
        if measured["breakdown"]:
            parts = ", ".join(f"{k} {_mib(v)}" for k, v in measured["breakdown"].items())
            print(f"  {method} memory_breakdown (MiB, rank 0): {parts}")
        if measured["comm_ops"]:
            parts = ", ".join(f"{op} {calls} calls {_mib(nbytes)} MiB" for op, (calls, nbytes) in
                              measured["comm_ops"].items())
            print(f"  {method} comm per step (rank 0): {parts}")


def time_ratio(summary: Summary, method: str) -> str:
    return f"{summary.time_x_ddp(method):.2f}" if method in summary.step_s and "ddp" in summary.step_s else "n/a"
