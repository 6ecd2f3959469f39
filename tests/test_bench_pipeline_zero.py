"""benchmarks/bench_pipeline_zero.py runs end to end on a small workload and its model state meets theory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_pipeline_zero_runs_and_model_state_matches_theory() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_pipeline_zero.py"), "--width", "64",
                           "--layers", "4", "--rows", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "every model state matches its theory (within 1%)" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 0 | 2 |")]
    assert len(rows) == 1 and float(rows[0].split("|")[8]) < 1.0  # ZeRO-2 holds less than ZeRO-1
