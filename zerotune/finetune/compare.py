"""``zerotune compare-methods``: the same model and data fine-tuned by several methods, measured side by side.

Each method is an ordinary ``zerotune finetune`` run of the recipe with ``method.type`` switched (and its
own lr where given), in its own process and output directory, so its memory is its own. From each run's
``summary.json`` and ``metrics.jsonl`` the table reports, against full fine-tuning:

* memory per rank: the engine's model state (parameters, gradients, masters, optimizer state: the ZeRO
  paper's accounting) and the process's peak resident memory, each as % of the full run's;
* steps to reach the full run's final eval metric, as % of the full run's own steps to it (and the
  convergence speed, its inverse); "not reached" when a method never gets there in the run;
* the final metric, and how much of the full run's improvement over the untouched model (its metric before
  the first step) it achieved;
* trainable parameters, and training throughput.

Nothing is estimated: a figure absent from a run (a failed method) is shown as such.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_METHODS = ("full", "lora", "prefix", "qlora")


@dataclass
class MethodRun:
    """One method's finished (or failed) run."""

    method: str
    directory: Path
    summary: dict[str, Any] = field(default_factory=dict)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, metric) of the evaluations after step 0
    error: str | None = None


def finetune_command(recipe: str | None, method: str, output: Path, overrides: list[str],
                     switched: str = "method.type") -> list[str]:
    """The ``zerotune finetune`` command of one compared run: ``switched`` (``method.type``, or ``objective.type``
    when comparing preference objectives) set to ``method``."""
    command = [sys.executable, "-m", "zerotune.cli.main", "finetune", *([recipe] if recipe else []),
               "--output-dir", str(output), "--set", f"{switched}={method}"]
    for override in overrides:
        command += ["--set", override]
    return command


def run_method(recipe: str | None, method: str, output: Path, overrides: list[str], metric: str,
               switched: str = "method.type") -> MethodRun:
    """Fine-tune with ``method``; its console output goes to ``output/finetune.log``."""
    output.mkdir(parents=True, exist_ok=True)
    log = output / "finetune.log"
    with open(log, "w") as handle:
        done = subprocess.run(finetune_command(recipe, method, output, overrides, switched), stdout=handle,
                              stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return MethodRun(method, output, error=f"exit status {done.returncode}: {tail[0][:200]} (see {log})")
    return read_run(method, output, metric)


def read_run(method: str, directory: Path, metric: str) -> MethodRun:
    """A finished run's summary and its evaluations of ``metric`` (``loss`` or ``accuracy``...)."""
    summary = json.loads((directory / "summary.json").read_text())
    evals = []
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "eval" and record["step"] > 0 and metric in record:
            evals.append((record["step"], float(record[metric])))
    return MethodRun(method, directory, summary, sorted(dict(evals).items()))


def steps_to_reach(evals: list[tuple[int, float]], target: float, greater_is_better: bool) -> int | None:
    """The first evaluated step whose metric is at least as good as ``target``."""
    for step, value in evals:
        if (value >= target) if greater_is_better else (value <= target):
            return step
    return None


def _per_rank_max(summary: dict[str, Any], key: str) -> float | None:
    values = summary.get(key)
    return max(values) if values else None


def _percent(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return 100.0 * value / reference


def compare(runs: list[MethodRun], metric: str, greater_is_better: bool, reference: str = "full"
            ) -> list[dict[str, Any]]:
    """One row per method, each figure measured, the percentages against the ``reference`` run (``full``)."""
    full = next((run for run in runs if run.method == reference and run.error is None), None)
    target = full.evals[-1][1] if full is not None and full.evals else None
    full_steps = (steps_to_reach(full.evals, target, greater_is_better)
                  if full is not None and target is not None else None)
    full_state = _per_rank_max(full.summary, "model_state_mib_per_rank") if full else None
    full_peak = _per_rank_max(full.summary, "peak_memory_mib_per_rank") if full else None
    base = full.summary.get("before") if full else None  # the untouched model's metric (before any step)
    full_gain = (target - base) if target is not None and base is not None else None
    rows: list[dict[str, Any]] = []
    for run in runs:
        if run.error is not None:
            rows.append({"method": run.method, "error": run.error})
            continue
        state = _per_rank_max(run.summary, "model_state_mib_per_rank")
        peak = _per_rank_max(run.summary, "peak_memory_mib_per_rank")
        reached = steps_to_reach(run.evals, target, greater_is_better) if target is not None else None
        best = (max if greater_is_better else min)(run.evals, key=lambda item: item[1]) if run.evals else None
        rows.append({
            "method": run.method, "model_state_mib": state, "model_state_pct_of_full": _percent(state, full_state),
            "peak_rss_mib": peak, "peak_rss_pct_of_full": _percent(peak, full_peak),
            "steps_to_full_final": reached, "steps_pct_of_full": _percent(reached, full_steps),
            "convergence_speed_pct_of_full": _percent(full_steps, reached),
            "final_metric": run.evals[-1][1] if run.evals else run.summary.get("after"),
            "improvement_pct_of_full": (_percent(run.evals[-1][1] - base, full_gain)
                                        if run.evals and full_gain and base is not None else None),
            "best_metric": best[1] if best else None, "best_step": best[0] if best else None,
            "steps": run.summary.get("steps"), "trainable_parameters": run.summary.get("trainable_parameters"),
            "samples_per_s": run.summary.get("samples_per_s"),
        })
    return rows


def _cell(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def format_table(rows: list[dict[str, Any]], metric: str, target: float | None, reference: str = "full",
                 label: str = "method") -> str:
    """The seed's method table as markdown, from the measured rows (percentages of the ``reference`` run's)."""
    reach = f"steps to {reference}'s final {metric}" + (f" ({target:.4f})" if target is not None else "")
    header = [label, f"model state / rank MiB (% of {reference})", f"peak RSS / rank MiB (% of {reference})", reach,
              f"convergence speed (% of {reference})", f"final {metric}", f"improvement (% of {reference}'s)",
              "trainable params", "samples/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['method']} | failed: {row['error']} |" + " |" * (len(header) - 2))
            continue
        steps = row["steps_to_full_final"]
        reach_cell = (f"{steps} ({_cell(row['steps_pct_of_full'], '{:.0f}')}%)" if steps is not None
                      else f"not reached in {row['steps']} (best {_cell(row['best_metric'], '{:.4f}')} at "
                           f"{row['best_step']})")
        lines.append("| " + " | ".join([
            row["method"],
            f"{_cell(row['model_state_mib'])} ({_cell(row['model_state_pct_of_full'], '{:.1f}')}%)",
            f"{_cell(row['peak_rss_mib'], '{:.0f}')} ({_cell(row['peak_rss_pct_of_full'], '{:.0f}')}%)",
            reach_cell, _cell(row["convergence_speed_pct_of_full"], "{:.0f}") + "%"
            if row["convergence_speed_pct_of_full"] is not None else "-",
            _cell(row["final_metric"], "{:.4f}"), _cell(row["improvement_pct_of_full"], "{:.0f}") + "%"
            if row["improvement_pct_of_full"] is not None else "-", _cell(row["trainable_parameters"], "{:,}"),
            _cell(row["samples_per_s"], "{:.2f}")]) + " |")
    return "\n".join(lines)


def plot_curves(runs: list[MethodRun], metric: str, path: Path) -> Path:
    """Eval metric (measured points) and per-step train loss of every method, one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 4.2), dpi=100)
    FigureCanvasAgg(figure)
    eval_axes, train_axes = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for run in runs:
        if run.error is not None:
            continue
        if run.evals:
            eval_axes.plot([s for s, _ in run.evals], [v for _, v in run.evals], marker="o", linestyle=":",
                           label=run.method)
        steps = [json.loads(line) for line in (run.directory / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if r.get("split") == "step"]
        if steps:
            train_axes.plot([r["step"] for r in steps], [r["loss"] for r in steps], label=run.method, alpha=0.8)
    eval_axes.set_title(f"eval {metric} (measured points)")
    train_axes.set_title("train loss per step")
    for axes in (eval_axes, train_axes):
        axes.set_xlabel("optimizer step")
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
