"""Tests for zerotune.monitor: logger, timers, scalar writers, step reporter."""

from __future__ import annotations

import csv
import logging
import os
import sys
import time
import types
from types import SimpleNamespace

import pytest

from zerotune.monitor.logging import CONSOLE_HANDLER, get_logger, log_rank0
from zerotune.monitor.step_report import StepReporter
from zerotune.monitor.timers import WallClockTimers
from zerotune.monitor.writers import ScalarWriters, csv_file_name


@pytest.fixture
def zerotune_log(caplog):
    """caplog attached directly to the "zerotune" logger (which does not propagate)."""
    logger = get_logger()
    handler = caplog.handler  # pytest gives each phase its own handler: remove the one added here
    logger.addHandler(handler)
    caplog.set_level(logging.INFO, logger="zerotune")
    yield caplog
    logger.removeHandler(handler)


class RecordingWriters(ScalarWriters):
    """ScalarWriters with an in-memory sink, to see exactly what the reporter writes."""

    def __init__(self) -> None:
        super().__init__([])
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.flushes = 0

    def write(self, step, scalars):
        self.rows.append((step, dict(scalars)))

    def flush(self):
        self.flushes += 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- logging -------------------------------------------------------------------------


def test_get_logger_installs_one_handler_and_formats_with_prefix(capsys):
    first = get_logger()
    second = get_logger()
    assert first is second and first.name == "zerotune"
    # pytest >= 9.2 attaches its capture handlers to non-propagating loggers too: count zerotune's own
    ours = [h for h in first.handlers if h.get_name() == CONSOLE_HANDLER]
    assert len(ours) == 1 and first.level == logging.INFO and not first.propagate
    text = ours[0].formatter.format(logging.makeLogRecord({"msg": "hello", "levelno": 20}))
    assert text.startswith("[zerotune] ") and text.endswith(" hello")


def test_log_rank0_logs_only_on_rank_zero(zerotune_log):
    log_rank0("value %d", 7, rank=1)
    log_rank0("value %d", 8, rank=0)
    assert [r.getMessage() for r in zerotune_log.records] == ["value 8"]


# --- timers --------------------------------------------------------------------------


def test_timers_accumulate_mean_per_call_and_reset():
    syncs = []
    timers = WallClockTimers(enabled=True, synchronize=lambda: syncs.append(1))
    for _ in range(2):
        with timers("forward"):
            time.sleep(0.01)
    timers.start("step")
    time.sleep(0.02)
    timers.stop("step")
    means = timers.window_means_ms(reset=False)
    assert list(means) == ["forward", "step"]
    assert 9.0 <= means["forward"] < 100.0 and 19.0 <= means["step"] < 200.0
    assert len(syncs) == 6  # one synchronize before every clock read
    assert timers.format({"forward": 12.34, "step": 5.0}) == "forward: 12.3ms | step: 5.0ms"
    assert timers.window_means_ms(reset=True) == means
    assert timers.window_means_ms() == {}


def test_timers_misuse_is_a_clear_error():
    timers = WallClockTimers(enabled=True)
    with pytest.raises(RuntimeError, match="'backward' was stopped but never started"):
        timers.stop("backward")
    timers.start("forward")
    with pytest.raises(RuntimeError, match="'forward' was started twice"):
        timers.start("forward")


def test_disabled_timers_do_nothing():
    """Their cost per call is measured by benchmarks/bench_instrumentation_overhead.py."""
    calls = []
    timers = WallClockTimers(enabled=False, synchronize=lambda: calls.append(1))
    timers.stop("never-started")  # no error: disabled timers ignore everything
    for _ in range(100):
        with timers("forward"):
            pass
    assert calls == [] and timers.window_means_ms() == {}
    assert timers("a") is timers("b")  # one shared no-op context, nothing allocated


# --- writers -------------------------------------------------------------------------


def test_csv_writer_uses_deepspeed_layout(tmp_path):
    block = SimpleNamespace(enabled=True, output_path=str(tmp_path), job_name="job")
    writers = ScalarWriters.from_config(None, block, None, rank=0)
    writers.write(1, {"Train/Samples/train_loss": 2.5, "Train/Samples/lr": 0.1})
    writers.write(2, {"Train/Samples/train_loss": 2.0})
    writers.close()
    assert csv_file_name("Train/Samples/train_loss") == "Train_Samples_train_loss.csv"
    with open(tmp_path / "job" / "Train_Samples_train_loss.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "train_loss"], ["1", "2.5"], ["2", "2.0"]]
    with open(tmp_path / "job" / "Train_Samples_lr.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "lr"], ["1", "0.1"]]

    # A resumed run appends rows without repeating the header.
    resumed = ScalarWriters.from_config(None, {"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
                                        None, rank=0)
    resumed.write(3, {"Train/Samples/lr": 0.05})
    resumed.close()
    with open(tmp_path / "job" / "Train_Samples_lr.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "lr"], ["1", "0.1"], ["3", "0.05"]]


def test_only_rank_zero_writes_and_disabled_blocks_make_no_sinks(tmp_path):
    block = SimpleNamespace(enabled=True, output_path=str(tmp_path), job_name="job")
    writers = ScalarWriters.from_config(block, block, None, rank=1)
    writers.write(1, {"x": 1.0})
    writers.close()
    assert writers.sinks == [] and not os.path.exists(tmp_path / "job")
    off = SimpleNamespace(enabled=False, output_path=str(tmp_path), job_name="job")
    assert ScalarWriters.from_config(off, off, off, rank=0).sinks == []


def test_empty_output_path_and_job_name_use_deepspeed_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    writers = ScalarWriters.from_config(None, SimpleNamespace(enabled=True, output_path="", job_name=""), None, rank=0)
    writers.write(1, {"a": 1.0})
    writers.close()
    assert (tmp_path / "runs" / "DeepSpeedJobName" / "a.csv").exists()


def test_tensorboard_writer_produces_readable_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    block = SimpleNamespace(enabled=True, output_path=str(tmp_path), job_name="tb_job")
    writers = ScalarWriters.from_config(block, None, None, rank=0)
    for step, loss in [(1, 3.0), (2, 2.5), (3, 2.0)]:
        writers.write(step, {"Train/Samples/train_loss": loss})
    writers.flush()
    writers.close()
    accumulator = EventAccumulator(str(tmp_path / "tb_job"))
    accumulator.Reload()
    events = accumulator.Scalars("Train/Samples/train_loss")
    assert [(e.step, e.value) for e in events] == [(1, 3.0), (2, 2.5), (3, 2.0)]


def test_missing_wandb_is_a_clear_error_on_every_rank(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    block = SimpleNamespace(enabled=True, team=None, group=None, project="p")
    for rank in (0, 1):
        with pytest.raises(ImportError, match="wandb.enabled is true but the wandb package is not installed; "
                                              "pip install wandb or disable it"):
            ScalarWriters.from_config(None, None, block, rank=rank)


def test_wandb_sink_inits_run_and_logs_by_step(monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    block = SimpleNamespace(enabled=True, team="t", group="g", project=None)
    writers = ScalarWriters.from_config(None, None, block, rank=0)
    writers.write(5, {"Train/Samples/lr": 0.5})
    writers.close()
    assert calls == [
        ("init", {"project": "deepspeed", "group": "g", "entity": "t"}),
        ("log", {"Train/Samples/lr": 0.5}, 5),
        ("finish",),
    ]


# --- step reporter -------------------------------------------------------------------


def test_step_reporter_prints_one_line_per_window_and_writes_every_step(zerotune_log):
    clock = FakeClock()
    writers = RecordingWriters()
    reporter = StepReporter(steps_per_print=4, rank=0, writers=writers, timers=None, clock=clock)
    for step in range(1, 9):
        clock.now += 0.5
        reporter.record(step=step, loss=float(step), lr=1e-3, grad_norm=0.25, loss_scale=None,
                        samples=8, skipped=False)
    lines = [r.getMessage() for r in zerotune_log.records]
    assert lines == [
        "step 4 | loss 2.5000 | lr 1.000e-03 | grad norm 0.25 | 16.0 samples/s",
        "step 8 | loss 6.5000 | lr 1.000e-03 | grad norm 0.25 | 16.0 samples/s",
    ]
    assert len(writers.rows) == 8 and writers.flushes == 2
    assert writers.rows[0] == (1, {"Train/Samples/lr": 1e-3, "Train/Samples/train_loss": 1.0,
                                   "Train/Samples/grad_norm": 0.25})


def test_step_reporter_summarizes_skipped_steps_and_loss_scale_change(zerotune_log):
    clock = FakeClock()
    writers = RecordingWriters()
    reporter = StepReporter(steps_per_print=5, rank=0, writers=writers, timers=None, clock=clock)
    # Scales after each step: overflow halves the scale, a clean step keeps it.
    plan = [(False, 65536.0), (False, 65536.0), (False, 65536.0), (False, 65536.0), (False, 65536.0),
            (True, 32768.0), (True, 16384.0), (False, 16384.0), (True, 8192.0), (False, 8192.0)]
    for step, (skipped, scale) in enumerate(plan, start=1):
        clock.now += 1.0
        reporter.record(step=step, loss=None if skipped else 1.0, lr=0.1, grad_norm=None, loss_scale=scale,
                        samples=4, skipped=skipped)
    lines = [r.getMessage() for r in zerotune_log.records]
    assert len(lines) == 2
    assert "skipped" not in lines[0] and "loss scale 65536" in lines[0]
    assert lines[1] == ("step 10 | loss 1.0000 | lr 1.000e-01 | loss scale 8192 | 4.0 samples/s | "
                        "skipped 3 steps (fp16 overflow) in this window, loss scale 65536 -> 8192")
    assert writers.rows[5] == (6, {"Train/Samples/lr": 0.1, "Train/Samples/loss_scale": 32768.0})


def test_step_reporter_appends_timer_means_and_writes_them(zerotune_log):
    timers = WallClockTimers(enabled=True)
    writers = RecordingWriters()
    reporter = StepReporter(steps_per_print=1, rank=0, writers=writers, timers=timers)
    with timers("forward"):
        pass
    reporter.record(step=1, loss=1.0, lr=0.1, grad_norm=1.0, loss_scale=None, samples=1, skipped=False)
    (line,) = [r.getMessage() for r in zerotune_log.records]
    assert " | forward: " in line and line.endswith("ms")
    assert "Train/Samples/elapsed_time_ms_forward" in writers.rows[-1][1]
    assert timers.window_means_ms() == {}  # the report reset the window


def test_step_reporter_is_silent_off_rank_zero_and_validates_interval(zerotune_log):
    writers = RecordingWriters()
    reporter = StepReporter(steps_per_print=1, rank=3, writers=writers, timers=None)
    reporter.record(step=1, loss=1.0, lr=0.1, grad_norm=1.0, loss_scale=None, samples=1, skipped=False)
    assert zerotune_log.records == [] and writers.rows == []
    with pytest.raises(ValueError, match="steps_per_print must be a positive integer, got 0"):
        StepReporter(steps_per_print=0, rank=0, writers=None, timers=None)


def test_no_capture_handlers_leak_onto_the_zerotune_logger_between_tests():
    """pytest >= 9.2 puts its per-phase capture handlers on non-propagating loggers and takes them off again;
    the per-test logger restore must not put an earlier phase's back (they would pile up over the suite)."""
    logger = get_logger()
    capture = [h for h in logger.handlers if type(h).__module__.startswith("_pytest")]
    assert len([h for h in capture if type(h).__name__ == "LogCaptureHandler"]) <= 2  # this phase's caplog + report


def test_wandb_extra_is_declared_and_the_missing_package_error_names_it(monkeypatch):
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(spec.startswith("wandb>=0.31") for spec in project["optional-dependencies"]["wandb"])
    monkeypatch.setitem(sys.modules, "wandb", None)
    block = SimpleNamespace(enabled=True, team=None, group=None, project="p")
    with pytest.raises(ImportError, match=r"pip install 'zerotune\[wandb\]'"):
        ScalarWriters.from_config(None, None, block, rank=0)
