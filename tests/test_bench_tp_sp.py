"""Smoke test of benchmarks/bench_tp_sp.py: tiny GPT-2, its own 2 spawned gloo ranks.

The benchmark exits nonzero when a measured TP / SP comm volume differs from its Megatron /
Ulysses formula or a loss differs from the 1-rank loss, so a zero exit is the real check; the
printed table is checked for the ratios it must contain.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_tp_sp.py"


@pytest.mark.slow
def test_bench_tp_sp_runs_and_comm_matches_formulas():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--layers", "1", "--width", "32", "--heads", "2", "--vocab", "64",
         "--seq", "32", "--batch", "2", "--steps", "1", "--warmup", "0"],
        check=False, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "all comm volumes match their formulas" in out, out
    # TP 2 splits all but LayerNorms, wpe and row biases: the measured ratio equals the theory line's.
    theory_line = next(line for line in out.splitlines() if line.startswith("TP 2 parameters per rank"))
    measured, theory = theory_line.split("measured ")[1].split()[0], theory_line.split("theory ")[1].split()[0]
    assert measured == theory, theory_line
    for op_line in [line for line in out.splitlines() if line.strip().startswith(("tp2 rank", "sp2 rank"))]:
        assert op_line.split()[-1] == "1.000", op_line


def test_bench_tp_sp_rejects_indivisible_sizes():
    result = subprocess.run([sys.executable, str(SCRIPT), "--heads", "3", "--width", "48"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--heads 3 must be divisible by 2" in result.stderr, result.stderr
