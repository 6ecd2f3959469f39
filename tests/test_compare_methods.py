"""``zerotune compare-methods``: the method table computed from measured runs (issue 17 item 6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_finetune_causal_lm import write_recipe
from zerotune.finetune.compare import MethodRun, compare, format_table, steps_to_reach


def _run(method: str, evals: list[tuple[int, float]], state: float, peak: float, trainable: int) -> MethodRun:
    return MethodRun(method, Path(method), {"model_state_mib_per_rank": [state, state - 1], "steps": 10,
                                            "peak_memory_mib_per_rank": [peak, peak], "trainable_parameters": trainable,
                                            "samples_per_s": 3.0, "after": evals[-1][1]}, evals)


def test_the_table_compares_each_method_with_the_full_run() -> None:
    runs = [_run("full", [(5, 2.0), (10, 1.0)], 400.0, 1000.0, 1000),
            _run("lora", [(5, 0.95), (10, 0.8)], 60.0, 500.0, 10),
            _run("prefix", [(5, 1.9), (10, 1.5)], 40.0, 450.0, 5)]
    rows = {row["method"]: row for row in compare(runs, "loss", greater_is_better=False)}
    assert rows["full"]["steps_to_full_final"] == 10 and rows["full"]["model_state_pct_of_full"] == 100.0
    assert rows["lora"]["steps_to_full_final"] == 5 and rows["lora"]["steps_pct_of_full"] == 50.0
    assert rows["lora"]["convergence_speed_pct_of_full"] == 200.0
    assert rows["lora"]["model_state_pct_of_full"] == 15.0 and rows["lora"]["peak_rss_pct_of_full"] == 50.0
    assert rows["prefix"]["steps_to_full_final"] is None and rows["prefix"]["best_metric"] == 1.5
    table = format_table(list(rows.values()), "eval loss", 1.0)
    assert "not reached in 10 (best 1.5000 at 10)" in table and "| lora | 60.0 (15.0%) | 500 (50%) | 5 (50%) | 200% |" in table
    failed = compare([runs[0], MethodRun("qlora", Path("q"), error="exit status 1: boom")], "loss", False)
    assert "failed: exit status 1: boom" in format_table(failed, "eval loss", 1.0)
    assert steps_to_reach([(5, 0.5), (10, 0.7)], 0.6, greater_is_better=True) == 10


def test_bad_methods_and_lrs_are_one_line_errors(capsys) -> None:
    from zerotune.cli.main import main

    assert main(["compare-methods", "--methods", "full,lorra"]) == 2
    assert "--methods: 'full,lorra': each must be one of full, lora" in capsys.readouterr().err
    assert main(["compare-methods", "--methods", "full,lora", "--lr", "prefix=0.01"]) == 2
    assert "--lr: 'prefix=0.01': expected METHOD=LR with METHOD one of full, lora" in capsys.readouterr().err
    assert main(["compare-methods", "--lr", "lora=fast"]) == 2
    assert "'fast' is not a number" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_methods_runs_each_method_and_prints_the_table(tmp_path) -> None:
    path = write_recipe(tmp_path, stage=2)
    recipe = json.loads(path.read_text())
    recipe["train"].update(max_steps=10, eval_every=5)
    path.write_text(json.dumps(recipe))
    out = tmp_path / "compare"
    done = subprocess.run([sys.executable, "-m", "zerotune.cli.main", "compare-methods", str(path), "--methods",
                           "full,lora,prefix", "--lr", "full=5e-3", "--output-dir", str(out)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["method"]: row for row in json.loads((out / "compare.json").read_text())["rows"]}
    assert set(rows) == {"full", "lora", "prefix"}
    assert rows["full"]["model_state_pct_of_full"] == 100.0
    assert rows["lora"]["trainable_parameters"] < rows["full"]["trainable_parameters"]
    assert rows["lora"]["model_state_pct_of_full"] < 100.0 and rows["prefix"]["model_state_pct_of_full"] < 100.0
    assert "| method | model state / rank MiB (% of full)" in done.stdout
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "compare.json").read_text())["lr"] == {"full": 5e-3, "lora": 2e-2, "prefix": 2e-2}
