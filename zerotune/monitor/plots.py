"""Turn a fine-tuning run directory into PNG plots and a short ``report.md``.

The fine-tuning loop writes ``metrics.jsonl`` (one JSON object per train log or eval)
and ``summary.json`` (before/after metric, throughput, peak memory). This module only
reads those two files, so a report can be made for a finished run, a crashed one, or a
run copied from another machine, without torch or the model.

matplotlib is imported inside the plotting function: ``import zerotune`` must stay fast
for ranks that never plot. Figures are drawn on an explicit Agg canvas instead of
through ``pyplot``, so no global backend or figure registry is touched.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
DEFAULT_OUT_SUBDIR = "report"

# Keys whose values are plotted or tabulated; each must be a number when present.
NUMERIC_KEYS = ("epoch", "loss", "lr", "samples_per_s", "time_s", "accuracy", "macro_f1", "perplexity")
SMOOTHING_MIN_POINTS = 20  # below this a moving average hides more than it shows


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message names the file (and line)."""


@dataclass
class RunMetrics:
    """The records of ``metrics.jsonl``, split by kind, one record per step, sorted by step: ``train`` (one per
    ``log_every`` window, with throughput), ``eval``, and ``steps`` (every optimizer step's loss and applied
    lr, so the warm-up and every step are plotted; runs logged before it existed have none)."""

    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)

    def per_step(self) -> list[dict[str, Any]]:
        """Every step's record where the run logged them, else the window records."""
        return self.steps or self.train


# ---------------------------------------------------------------------------- reading


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_record(record: Any, where: str) -> dict[str, Any]:
    """Validate one decoded line; ``where`` is ``path:line`` for the error message."""
    if not isinstance(record, dict):
        raise ReportError(f"{where}: expected a JSON object, got {type(record).__name__}")
    split = record.get("split")
    if not isinstance(split, str):
        raise ReportError(f"{where}: missing or non-string 'split' (expected 'train' or 'eval'), got {split!r}")
    step = record.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool)):
        raise ReportError(f"{where}: 'step' must be an integer, got {step!r}")
    for key in NUMERIC_KEYS:
        if key in record and record[key] is not None and not _is_number(record[key]):
            raise ReportError(f"{where}: '{key}' must be a number, got {record[key]!r}")
    return record


def load_metrics(run_dir: Path) -> RunMetrics:
    """Read ``run_dir/metrics.jsonl``; a bad line raises ``ReportError`` naming file and line.

    A resumed run re-logs the steps between its last checkpoint and the crash, so the
    same (split, step) can appear twice: the later line wins, as it comes from the run
    whose weights were kept. Splits other than train/eval/step are accepted and ignored, so
    the loop can add new kinds of lines without breaking old reports.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{path}: no such file (expected one JSON object per line, written by `zerotune finetune`)")
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from None
    by_split: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "eval": {}, "step": {}}
    seen_any = False
    for number, raw in enumerate(raw_lines, start=1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ReportError(f"{where}: not valid UTF-8 text") from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        record = _check_record(record, where)
        seen_any = True
        if record["split"] in by_split:
            by_split[record["split"]][record["step"]] = record
    if not seen_any:
        raise ReportError(f"{path}: contains no metric lines (has the run logged its first step yet?)")
    return RunMetrics(
        train=[by_split["train"][step] for step in sorted(by_split["train"])],
        eval=[by_split["eval"][step] for step in sorted(by_split["eval"])],
        steps=[by_split["step"][step] for step in sorted(by_split["step"])],
    )


def load_summary(run_dir: Path) -> dict[str, Any]:
    """Read ``run_dir/summary.json`` if it exists (a run still in progress has none yet)."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    for key in ("before", "after", "wall_seconds", "samples_per_s", "steps", "zero_stage"):
        if summary.get(key) is not None and not _is_number(summary[key]):
            raise ReportError(f"{path}: '{key}' must be a number, got {summary[key]!r}")
    memory = summary.get("peak_memory_mib_per_rank")
    if memory is not None and not (isinstance(memory, list) and all(_is_number(m) for m in memory)):
        raise ReportError(f"{path}: 'peak_memory_mib_per_rank' must be a list of numbers, got {memory!r}")
    return summary


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry a numeric ``key``."""
    pairs = [(r["step"], float(r[key])) for r in records if _is_number(r.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values, ignoring non-finite ones (NaN loss steps)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


# ---------------------------------------------------------------------------- plotting


def _title(summary: dict[str, Any], what: str) -> str:
    parts = [str(summary[k]) for k in ("model", "task", "method") if summary.get(k) not in (None, "")]
    if summary.get("zero_stage") is not None:
        parts.append(f"ZeRO-{summary['zero_stage']}")
    return f"{what}\n{' · '.join(parts)}" if parts else what


def _new_figure(rows: int = 1) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.0 * rows), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _finish(fig: Any, axes: list[Any], path: Path) -> Path:
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _plot_loss(metrics: RunMetrics, summary: dict[str, Any], path: Path) -> Path | None:
    train_steps, train_loss = _series(metrics.per_step(), "loss")
    eval_steps, eval_loss = _series(metrics.eval, "loss")
    if not train_steps and not eval_steps:
        return None
    fig = _new_figure()
    ax = fig.add_subplot(1, 1, 1)
    if train_steps:
        smooth = len(train_steps) >= SMOOTHING_MIN_POINTS
        ax.plot(train_steps, train_loss, color="tab:blue", alpha=0.35 if smooth else 1.0, label="train loss")
        if smooth:
            window = max(2, len(train_steps) // 20)
            ax.plot(train_steps, _moving_average(train_loss, window), color="tab:blue",
                    label=f"train loss (mean of last {window} points)")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, **_measured(eval_steps), color="tab:orange", label="eval loss")
    ax.set_ylabel("loss")
    ax.set_title(_title(summary, "Loss"))
    return _finish(fig, [ax], path)


def _measured(steps: list[int]) -> dict[str, Any]:
    """Evaluations are points as measured: markers, joined by a faint dotted guide only when there are enough
    of them to show a trend (two points joined would read as a measured straight line)."""
    if len(steps) < 3:
        return {"marker": "o", "linestyle": "none"}
    return {"marker": "o", "linestyle": ":", "linewidth": 1.0}


def _plot_single(records: list[dict[str, Any]], key: str, label: str, title: str, summary: dict[str, Any],
                 path: Path) -> Path | None:
    steps, values = _series(records, key)
    if not steps:
        return None
    fig = _new_figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, values, color="tab:green", marker="." if len(steps) < 50 else None)
    ax.set_ylabel(label)
    ax.set_title(_title(summary, title))
    if key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return _finish(fig, [ax], path)


def _plot_eval_metrics(metrics: RunMetrics, summary: dict[str, Any], path: Path) -> Path | None:
    """Classification scores (0..1) and perplexity (unbounded) get separate panels."""
    scores = [(key, *_series(metrics.eval, key)) for key in ("accuracy", "macro_f1")]
    scores = [s for s in scores if s[1]]
    ppl_steps, ppl = _series(metrics.eval, "perplexity")
    panels = int(bool(scores)) + int(bool(ppl_steps))
    if panels == 0:
        return None
    fig = _new_figure(rows=panels)
    axes = []
    if scores:
        ax = fig.add_subplot(panels, 1, 1)
        for key, steps, values in scores:
            ax.plot(steps, values, **_measured(steps), label={"accuracy": "accuracy", "macro_f1": "macro-F1"}[key])
        ax.set_ylabel("score")
        ax.set_title(_title(summary, "Evaluation"))
        axes.append(ax)
    if ppl_steps:
        ax = fig.add_subplot(panels, 1, panels)
        ax.plot(ppl_steps, ppl, **_measured(ppl_steps), color="tab:red", label="perplexity")
        ax.set_ylabel("perplexity")
        if not scores:
            ax.set_title(_title(summary, "Evaluation"))
        axes.append(ax)
    return _finish(fig, axes, path)


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write loss.png, lr.png, throughput.png and eval_metrics.png (each only if it has data).

    ``out_dir`` defaults to ``run_dir/report``. Returns the paths written, in that order.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    out_dir = run_dir / DEFAULT_OUT_SUBDIR if out_dir is None else Path(out_dir)
    metrics = load_metrics(run_dir)
    summary = load_summary(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        _plot_loss(metrics, summary, out_dir / "loss.png"),
        _plot_single(metrics.per_step(), "lr", "learning rate", "Learning rate", summary, out_dir / "lr.png"),
        _plot_single(metrics.train, "samples_per_s", "samples / s", "Throughput", summary,
                     out_dir / "throughput.png"),
        _plot_eval_metrics(metrics, summary, out_dir / "eval_metrics.png"),
    ]
    return [path for path in written if path is not None]


# ---------------------------------------------------------------------------- markdown


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(label, str(summary[key])) for key, label in
            (("model", "model"), ("task", "task"), ("method", "method"), ("zero_stage", "ZeRO stage"))
            if summary.get(key) is not None]
    metric = summary.get("metric", "metric")
    before, after = summary.get("before"), summary.get("after")
    if before is not None and after is not None:
        delta = after - before
        relative = f" ({delta / before:+.1%})" if before != 0 else ""
        better = "lower is better" if "loss" in str(metric) or "perplexity" in str(metric) else "higher is better"
        rows.append((f"{metric} (before -> after)", f"{before:.4f} -> {after:.4f}"))
        rows.append((f"{metric} delta", f"{delta:+.4f}{relative}, {better}"))
    else:
        rows += [(f"{metric} {k}", f"{summary[k]:.4f}") for k in ("before", "after") if summary.get(k) is not None]
    if summary.get("steps") is not None:
        rows.append(("steps", str(summary["steps"])))
    if summary.get("wall_seconds") is not None:
        seconds = float(summary["wall_seconds"])
        rows.append(("wall time", f"{seconds:.1f} s ({seconds / 60:.1f} min)"))
    if summary.get("samples_per_s") is not None:
        rows.append(("samples/s", f"{summary['samples_per_s']:.2f}"))
    memory = summary.get("peak_memory_mib_per_rank")
    if memory:
        per_rank = ", ".join(f"{m:.0f}" for m in memory)
        rows.append(("peak memory (MiB per rank)", f"{per_rank} (max {max(memory):.0f})"))
    return rows


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> list[str]:
    escape = lambda text: text.replace("|", "\\|")  # noqa: E731 -- a pipe would split the cell
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    return lines + [f"| {escape(k)} | {escape(v)} |" for k, v in rows]


def write_summary_markdown(run_dir: Path, out_dir: Path, images: list[Path]) -> Path:
    """Write ``out_dir/report.md``: summary table, the last eval line, and the images.

    Images are linked relative to ``out_dir`` so the report still renders after the
    whole run directory is copied or archived elsewhere.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    summary = load_summary(run_dir)
    metrics = load_metrics(run_dir)
    lines = [f"# Fine-tuning report: {run_dir.resolve().name}", ""]
    if summary:
        lines += ["## Summary", ""] + _table(_summary_rows(summary), ("", "value")) + [""]
    else:
        lines += [f"No `{SUMMARY_FILE}` in `{run_dir}` yet (the run may still be going or may have stopped early).", ""]
    if metrics.eval:
        last = metrics.eval[-1]
        rows = [(key, _fmt(value)) for key, value in last.items() if key != "split"]
        lines += [f"## Last evaluation (step {last['step']})", ""] + _table(rows, ("key", "value")) + [""]
    if metrics.train:
        last = metrics.train[-1]
        lines += [f"Train log lines: {len(metrics.train)}, last at step {last['step']}"
                  + (f" (loss {_fmt(last['loss'])})." if _is_number(last.get("loss")) else "."), ""]
    if images:
        lines += ["## Plots", ""]
        for image in images:
            relative = Path(os.path.relpath(Path(image).resolve(), out_dir.resolve())).as_posix()
            lines += [f"![{Path(image).stem}]({relative})", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_FILE
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
