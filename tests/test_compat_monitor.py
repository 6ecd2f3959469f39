"""``deepspeed.monitor`` (``zerotune.compat.monitor``): DeepSpeed's monitor classes write ``(tag, value, step)`` events
through zerotune's scalar writers, from the engine's own config sections; Comet refused."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from tests.harness import run_distributed
from zerotune.compat.monitor import (
    CometMonitor,
    DeepSpeedMonitorConfig,
    MonitorMaster,
    TensorBoardMonitor,
    WandbMonitor,
    csvMonitor,
    get_monitor_config,
)
from zerotune.compat.paths import DeepSpeedFeatureNotSupported

EVENTS = [("Train/Samples/train_loss", 3.0, 1), ("Train/Samples/lr", 0.1, 1), ("Train/Samples/train_loss", 2.5, 2)]


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_config_defaults_blocks_and_enabled() -> None:
    defaults = DeepSpeedMonitorConfig()
    assert (defaults.tensorboard.enabled, defaults.tensorboard.output_path, defaults.tensorboard.job_name) == (
        False, "", "DeepSpeedJobName")
    assert (defaults.wandb.project, defaults.wandb.team, defaults.csv_monitor.enabled) == ("deepspeed", None, False)
    assert not defaults.enabled
    config = get_monitor_config({"csv_monitor": {"enabled": True, "job_name": "j"}, "comet": {"enabled": False}})
    assert config.enabled and config.csv_monitor.job_name == "j"


def test_bad_blocks_are_clear_errors() -> None:
    with pytest.raises(DeepSpeedFeatureNotSupported, match="Comet"):
        DeepSpeedMonitorConfig(comet={"enabled": True})
    with pytest.raises(Exception, match="job_nam"):
        DeepSpeedMonitorConfig(tensorboard={"job_nam": "x"})  # unknown key, as the engine's config
    with pytest.raises(TypeError, match="'wandb'"):
        DeepSpeedMonitorConfig(wandb=["enabled"])
    with pytest.raises(DeepSpeedFeatureNotSupported, match="Comet monitor"):
        CometMonitor(object())


def test_deepspeed_config_exposes_the_engine_sections() -> None:
    from zerotune.compat.runtime import DeepSpeedConfig

    ds_config = DeepSpeedConfig({"train_batch_size": 2, "tensorboard": {"enabled": True, "output_path": "o/",
                                                                        "job_name": "test"}})
    block = ds_config.monitor_config.tensorboard
    assert (block.enabled, block.output_path, block.job_name) == (True, "o/", "test")
    assert ds_config.monitor_config.enabled and not ds_config.monitor_config.wandb.enabled


def test_csv_monitor_writes_through_zerotune_csv_layout(tmp_path: Path) -> None:
    monitor = csvMonitor(get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                             "job_name": "run"}}).csv_monitor)
    assert monitor.enabled and monitor.log_dir == str(tmp_path / "run")
    monitor.write_events(EVENTS)
    monitor.close()
    assert _rows(tmp_path / "run" / "Train_Samples_train_loss.csv") == [["step", "train_loss"], ["1", "3.0"],
                                                                        ["2", "2.5"]]
    assert _rows(tmp_path / "run" / "Train_Samples_lr.csv") == [["step", "lr"], ["1", "0.1"]]


def test_tensorboard_monitor_writes_a_readable_event_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitor = TensorBoardMonitor(get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path),
                                                                     "job_name": "tb"}}).tensorboard)
    assert (monitor.enabled, monitor.output_path, monitor.job_name) == (True, str(tmp_path), "tb")
    monitor.write_events(EVENTS)
    monitor.close()
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("Train/Samples/train_loss")] == [(1, 3.0), (2, 2.5)]


def test_disabled_monitors_write_nothing_and_need_no_package(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` would fail: a disabled block never imports it
    config = get_monitor_config({"wandb": {"group": "g", "team": "t", "project": "p"},
                                 "csv_monitor": {"output_path": str(tmp_path)}})
    wandb_monitor = WandbMonitor(config.wandb)
    assert (wandb_monitor.enabled, wandb_monitor.group, wandb_monitor.team, wandb_monitor.project) == (
        False, "g", "t", "p")
    wandb_monitor.write_events(EVENTS)
    master = MonitorMaster(config)
    assert not master.enabled and master.csv_monitor is None
    master.write_events(EVENTS)
    assert list(tmp_path.iterdir()) == []


def test_monitor_master_fans_out_to_every_enabled_backend(tmp_path: Path) -> None:
    config = get_monitor_config({"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
                                 "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"}})
    master = MonitorMaster(config)
    assert master.enabled and master.tb_monitor is not None and master.wandb_monitor is None
    master.write_events(iter(EVENTS))  # any iterable: each backend sees every event
    assert _rows(tmp_path / "csv" / "Train_Samples_lr.csv")[1] == ["1", "0.1"]
    assert any((tmp_path / "tb").iterdir())


def _csv_on_ranks(root: str) -> dict:
    import torch.distributed as dist

    monitor = csvMonitor(get_monitor_config({"csv_monitor": {"enabled": True, "output_path": root,
                                                             "job_name": f"r{dist.get_rank()}"}}).csv_monitor)
    monitor.write_events(EVENTS)
    monitor.close()
    return {"log_dir": monitor.log_dir, "files": sorted(p.name for p in Path(root).rglob("*.csv"))}


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    results = run_distributed(_csv_on_ranks, 2, str(tmp_path))
    assert results[0]["log_dir"] == str(tmp_path / "r0") and results[1]["log_dir"] is None
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.csv")) == [
        "r0/Train_Samples_lr.csv", "r0/Train_Samples_train_loss.csv"]
