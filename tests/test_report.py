"""``zerotune report``: PNG plots and report.md from a synthesized fine-tuning run directory."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from zerotune.cli.report import add_report_parser, run_report
from zerotune.monitor.plots import ReportError, load_metrics, plot_run, write_summary_markdown

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, task: str, *, summary: bool = True, steps: int = 40) -> Path:
    """A run directory shaped like `zerotune finetune` output (classification or causal LM)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        lines.append({"split": "train", "step": step, "epoch": step / steps, "loss": 2.0 * math.exp(-step / 15) + 0.3,
                      "lr": 5e-5 * min(1.0, step / 5), "samples_per_s": 50.0 + step % 7, "time_s": 0.3 * step,
                      "grad_norm": 1.5})  # an extra key the report does not know about
        if step % 10 == 0 or step == 1:
            record = {"split": "eval", "step": step, "loss": 1.5 * math.exp(-step / 20) + 0.4}
            if task == "classification":
                record.update(accuracy=0.55 + step / 400, macro_f1=0.5 + step / 400)
            else:
                record["perplexity"] = math.exp(record["loss"])
            lines.append(record)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    if summary:
        metric, before, after = ("accuracy", 0.57, 0.66) if task == "classification" else ("eval_loss", 2.8, 1.92)
        (run_dir / "summary.json").write_text(json.dumps({
            "metric": metric, "before": before, "after": after, "steps": steps, "wall_seconds": 31.5,
            "samples_per_s": 52.25, "peak_memory_mib_per_rank": [812.0, 790.4], "task": task, "method": "lora",
            "model": "tiny-model", "zero_stage": 2}))
    return run_dir


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 1024, f"{path} is suspiciously small ({len(data)} bytes)"


def _namespace(run_dir: Path, out: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(run_dir=str(run_dir), out=None if out is None else str(out))


def test_classification_run_writes_all_plots_and_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = _write_run(tmp_path / "run", "classification")
    assert run_report(_namespace(run_dir)) == 0
    out_dir = run_dir / "report"
    names = ["loss.png", "lr.png", "throughput.png", "eval_metrics.png"]
    for name in names:
        _assert_png(out_dir / name)
    printed = capsys.readouterr().out.split()
    assert printed == [str(out_dir / name) for name in names] + [str(out_dir / "report.md")]
    report = (out_dir / "report.md").read_text()
    assert "0.5700 -> 0.6600" in report and "+0.0900" in report and "higher is better" in report
    assert "accuracy (before -> after)" in report
    assert "peak memory (MiB per rank) | 812, 790 (max 812)" in report
    assert "Last evaluation (step 40)" in report and "macro_f1" in report
    for name in names:
        assert f"]({name})" in report  # embedded relative to report.md


def test_causal_lm_run_plots_perplexity_and_shows_loss_drop(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", "causal-lm")
    out_dir = tmp_path / "elsewhere"
    images = plot_run(run_dir, out_dir)
    assert [p.name for p in images] == ["loss.png", "lr.png", "throughput.png", "eval_metrics.png"]
    for image in images:
        _assert_png(image)
    report = write_summary_markdown(run_dir, out_dir, images).read_text()
    assert "eval_loss (before -> after)" in report and "2.8000 -> 1.9200" in report
    assert "-0.8800 (-31.4%), lower is better" in report
    assert "perplexity" in report and "accuracy" not in report


def test_out_option_and_no_summary_still_reports(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", "classification", summary=False)
    out_dir = tmp_path / "nested" / "out"
    assert run_report(_namespace(run_dir, out_dir)) == 0
    report = (out_dir / "report.md").read_text()
    assert "No `summary.json`" in report and "![loss](loss.png)" in report
    assert not (run_dir / "report").exists()


def test_train_only_run_skips_eval_plot(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"split": "train", "step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 5)))
    images = plot_run(run_dir)
    assert [p.name for p in images] == ["loss.png"]  # no lr / throughput / eval data to plot


def test_resumed_run_keeps_the_later_line_for_a_repeated_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"split": "train", "step": s, "loss": 9.0} for s in (1, 2, 3)]  # crashed after checkpoint at step 1
    lines += [{"split": "train", "step": s, "loss": 1.0} for s in (2, 3, 4)]  # resumed from step 1
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    metrics = load_metrics(run_dir)
    assert [(r["step"], r["loss"]) for r in metrics.train] == [(1, 9.0), (2, 1.0), (3, 1.0), (4, 1.0)]


def test_argparse_registration(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="zerotune")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(tmp_path), "--out", str(tmp_path / "o")])
    assert args.func is run_report and args.run_dir == str(tmp_path) and args.out == str(tmp_path / "o")


@pytest.mark.parametrize("content, expected", [
    ('{"split": "train", "step": 1, "loss": 1.0}\n\n{"split": "train", "step": 2, "loss": \n', "metrics.jsonl:3: not valid JSON"),
    ('{"split": "train", "step": 1}\n[1, 2]\n', "metrics.jsonl:2: expected a JSON object, got list"),
    ('{"split": "train", "step": "one"}\n', "metrics.jsonl:1: 'step' must be an integer, got 'one'"),
    ('{"step": 1, "loss": 1.0}\n', "metrics.jsonl:1: missing or non-string 'split'"),
    ('{"split": "eval", "step": 1, "accuracy": "high"}\n', "metrics.jsonl:1: 'accuracy' must be a number"),
    ("\n\n", "metrics.jsonl: contains no metric lines"),
])
def test_malformed_metrics_name_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture, content: str,
                                              expected: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(content)
    assert run_report(_namespace(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerotune report: ") and expected in err, err


def test_missing_dir_missing_metrics_and_bad_summary(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_report(_namespace(tmp_path / "nope")) == 2
    assert "nope: no such run directory" in capsys.readouterr().err
    assert run_report(_namespace(tmp_path)) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
    run_dir = _write_run(tmp_path / "run", "classification")
    (run_dir / "summary.json").write_text('{"before": "0.5"}')
    assert run_report(_namespace(run_dir)) == 2
    assert "summary.json: 'before' must be a number, got '0.5'" in capsys.readouterr().err
    (run_dir / "summary.json").write_text("{oops")
    assert run_report(_namespace(run_dir)) == 2
    assert "summary.json: not valid JSON" in capsys.readouterr().err


def test_plot_run_raises_report_error_for_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="no such run directory"):
        plot_run(tmp_path / "missing")


def test_module_entry_point_one_line_error_and_lazy_matplotlib(tmp_path: Path) -> None:
    """Runs the module as ``__main__`` (what ``python -m zerotune.cli.report`` does) in one
    subprocess, then reports on stdout whether matplotlib got imported on the error path."""
    (tmp_path / "metrics.jsonl").write_text('{"split": "train", "step": 1}\nnot json\n')
    script = ("import runpy, sys\n"
              f"sys.argv = ['zerotune report', {str(tmp_path)!r}]\n"
              "try:\n"
              "    runpy.run_module('zerotune.cli.report', run_name='__main__')\n"
              "finally:\n"
              "    print('matplotlib' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "metrics.jsonl:2: not valid JSON" in done.stderr
    assert done.stdout.strip() == "False"  # `import zerotune` paths never pay for matplotlib


def test_every_step_record_is_plotted_and_evaluations_are_points_as_measured(tmp_path: Path) -> None:
    """Issue 17: lr from the first step (the warm-up was invisible with one point per 10-step window) and
    two evaluations drawn as two points, not as a measured straight line."""
    from zerotune.monitor import plots

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"split": "eval", "step": 0, "loss": 3.0}]
    lines += [{"split": "step", "step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3 * min(1.0, s / 5)} for s in range(1, 21)]
    lines += [{"split": "train", "step": s, "loss": 2.0, "lr": 1e-3, "samples_per_s": 9.0} for s in (10, 20)]
    lines += [{"split": "eval", "step": 20, "loss": 1.0}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    metrics = plots.load_metrics(run_dir)
    assert [r["step"] for r in metrics.per_step()] == list(range(1, 21))
    drawn = {}

    real = plots._finish

    def capture(fig, axes, path):
        drawn[path.name] = [(list(line.get_xdata()), line.get_linestyle()) for ax in axes for line in ax.get_lines()]
        return real(fig, axes, path)

    import unittest.mock

    with unittest.mock.patch.object(plots, "_finish", capture):
        plots.plot_run(run_dir)
    assert drawn["lr.png"][0][0] == list(range(1, 21))
    assert drawn["loss.png"][0][0] == list(range(1, 21))
    assert drawn["loss.png"][-1] == ([0, 20], "None")  # eval: markers only
