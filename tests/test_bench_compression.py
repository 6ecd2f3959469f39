"""Smoke test of benchmarks/bench_compression.py: a tiny GPT-2, its own 2 spawned gloo ranks, a few steps.

Too few steps for the eval-loss target (the benchmark may exit 1 for it), so the checks are the
ones that hold at any length: every run appears in the table, Top-K 0.01 moves 2% of the dense
gradient bytes per step at stage 0 (k = ceil(0.01 n) int32 indices + fp32 values gathered from 2
ranks, 16 k bytes, against the all-reduce's 2 x 4 n in the ZeRO-paper convention) and 4% at stage 2
(whose dense reduce counts 4 n), the byte verdict passes, and the PNG is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_compression.py"
sys.path.insert(0, str(SCRIPT.parent))


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_bench_compression_counts_bytes_and_plots(tmp_path, stage):
    png = tmp_path / "curves.png"
    result = _run("--stage", str(stage), "--steps", "6", "--eval-every", "3", "--layers", "1", "--width", "32",
                  "--heads", "2", "--vocab", "16", "--seq", "16", "--micro", "4", "--eval-sequences", "8",
                  "--out", str(png))
    assert result.returncode in (0, 1), result.stdout + result.stderr
    out = result.stdout
    names = ("dense", "topk 0.1 +EF", "topk 0.01 +EF", "topk 0.01 no EF")
    rows = {name: line.split() for line in out.splitlines() for name in names if line.startswith(name + " ")}
    assert set(rows) == set(names), out
    # x dense of the gradient bytes: the column after "grad KiB/step" (names are 2-3 words)
    x_dense = {name: float(cells[len(name.split()) + 1]) for name, cells in rows.items()}
    assert x_dense["dense"] == 1.0
    per_ratio = 2 if stage == 0 else 4  # sparse bytes / dense bytes = per_ratio x ratio
    assert x_dense["topk 0.01 +EF"] == pytest.approx(0.01 * per_ratio, abs=0.002), out
    assert x_dense["topk 0.01 no EF"] == x_dense["topk 0.01 +EF"]
    assert x_dense["topk 0.1 +EF"] == pytest.approx(0.1 * per_ratio, abs=0.01), out
    assert "below dense (target >= 90%): PASS" in out, out
    assert ("ACCEPTANCE NOT MET" in out) == (result.returncode == 1)
    assert png.stat().st_size > 10_000
    assert f"loss curves: {png}" in out


def test_markov_language_follows_its_table():
    import bench_compression as bench

    table = bench.markov_table(8, 2, seed=0)
    ids = bench.sample_sequences(table, 8, 2, count=64, seq=20, noise=0.0, seed=1)
    contexts = ids[:, :-2] * 8 + ids[:, 1:-1]
    assert (ids[:, 2:] == table[contexts]).all()
    noisy = bench.sample_sequences(table, 8, 2, count=256, seq=20, noise=0.5, seed=1)
    followed = (noisy[:, 2:] == table[noisy[:, :-2] * 8 + noisy[:, 1:-1]]).float().mean().item()
    assert followed == pytest.approx(0.5 + 0.5 / 8, abs=0.03)
    assert bench.entropy_floor(8, 0.0) == 0.0


def test_bench_compression_rejects_bad_arguments():
    result = _run("--width", "48", "--heads", "5", timeout=60)
    assert result.returncode == 2 and "--width 48 must be divisible by --heads 5" in result.stderr
