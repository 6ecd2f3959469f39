"""benchmarks/bench_pipeline.py: the bubble arithmetic on hand-built timelines, and a tiny end-to-end run.

The benchmark exits nonzero when a stage's activation peak is not in-flight x per-micro-batch, so a
zero exit is the memory check (1F1B holds at most P micro-batches, GPipe M); the bubble numbers are
timings and only their arithmetic is checked exactly, here, on timelines whose answer is known.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_pipeline.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ideal_gpipe(micro_batches: int, stages: int, fwd: float, bwd: float) -> list[list[tuple]]:
    """GPipe with equal stages and free communication: forward (s, m) starts at (s + m) fwd, the last
    stage's backwards follow its forwards, stage s's backward m waits for stage s + 1's."""
    drain = (micro_batches + stages - 1) * fwd
    return [[("forward", m, (s + m) * fwd, (s + m + 1) * fwd) for m in range(micro_batches)]
            + [("backward", m, drain + (m + stages - 1 - s) * bwd, drain + (m + stages - s) * bwd)
               for m in range(micro_batches)] for s in range(stages)]


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 8), (3, 4), (4, 4), (4, 7)])
def test_ideal_gpipe_timeline_has_the_theoretical_bubble(stages, micro_batches):
    bench = _bench()
    timelines = _ideal_gpipe(micro_batches, stages, 1.0, 2.0)
    theory = bench.theory_bubble(micro_batches, stages)
    assert bench.stage_bubbles(timelines) == pytest.approx([theory] * stages)
    assert bench.mean_bubbles([[t, t] for t in timelines]) == pytest.approx([theory] * stages)
    # replaying the same durations with free communication reproduces the ideal span
    assert bench.replay_span("gpipe", timelines) == pytest.approx((micro_batches + stages - 1) * 3.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 9)])
def test_replay_of_equal_stages_gives_the_theoretical_bubble_for_both_schedules(schedule, stages, micro_batches):
    bench = _bench()
    from zerotune.pipe.schedule import build_schedule

    # durations only matter to the replay: forward 1, backward 2 on every stage
    timelines = [[(a.kind, a.micro_batch, 0.0, 1.0 if a.kind == "forward" else 2.0)
                  for a in build_schedule(schedule, micro_batches, stages, s)] for s in range(stages)]
    bubbles, _ = bench.replay_bubbles(schedule, [[t] for t in timelines])
    assert bubbles == pytest.approx([bench.theory_bubble(micro_batches, stages)] * stages)


def test_a_pipeline_waiting_on_communication_shows_more_bubble_than_its_replay():
    bench = _bench()
    timelines = _ideal_gpipe(4, 2, 1.0, 2.0)
    # each activation takes 0.5 to reach stage 1: stage 1 and stage 0's backwards start 0.5 later
    delayed = [[(k, m, start + (0.5 if k == "backward" or s == 1 else 0.0), end + (0.5 if k == "backward" or s == 1
                 else 0.0)) for k, m, start, end in timeline] for s, timeline in enumerate(timelines)]
    measured = bench.stage_bubbles(delayed)
    replayed, stretch = bench.replay_bubbles("gpipe", [[t] for t in delayed])
    assert all(b > r for b, r in zip(measured, replayed))
    assert stretch == pytest.approx((15.0 + 0.5) / 15.0)


def test_bench_pipeline_runs_and_activations_match_in_flight():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--width", "32", "--rows", "4", "--layers", "4", "--micro-batches", "2", "4",
         "--steps", "1", "--warmup", "0"],
        check=False, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "every activation peak = in-flight x per-micro-batch" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith(("gpipe ", "1f1b "))]
    assert len(rows) == 2 * 2 * 2  # schedules x M x stages
    for schedule, m, stage, *_, in_flight, _peak, _per_mb, times, _alloc in rows:
        expected = int(m) if schedule == "gpipe" else 2 - int(stage)
        assert int(in_flight) == expected and float(times) == pytest.approx(expected), rows
    assert "M=4: stage 0: 2.00 (theory 2.00), stage 1: 4.00 (theory 4.00)" in out, out


def test_bench_pipeline_rejects_too_few_micro_batches_for_1f1b():
    result = subprocess.run([sys.executable, str(SCRIPT), "--micro-batches", "1", "4"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--micro-batches [1] < --stages 2: 1F1B needs M >= P" in result.stderr, result.stderr
