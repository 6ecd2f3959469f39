"""``deepspeed.monitor`` (``config``, ``monitor``, ``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``): DeepSpeed's
monitor classes over zerotune's scalar writers.

Each monitor is one backend of ``zerotune.monitor.writers.ScalarWriters``, built from the same config section the
engine uses (``tensorboard`` / ``csv_monitor``: ``MonitorConfig``, ``wandb``: ``WandbConfig``), so
``write_events([(tag, value, step), ...])`` lands in the files the engine's own metrics go to, with the same
rank-0-only rule and the same layout (``output_path/job_name``; one CSV per tag). ``MonitorMaster`` fans out to the
enabled ones, as DeepSpeed's. zerotune has no Comet writer and accepts the config's ``comet`` block only disabled,
so ``CometMonitor`` is refused when built and an enabled ``comet`` block is refused here as there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping

from zerotune.compat.comm import get_rank
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.compat.refusals import refused_class
from zerotune.config.sections import MonitorConfig, WandbConfig
from zerotune.monitor.writers import CsvSink, ScalarWriters

__all__ = ["DeepSpeedMonitorConfig", "TensorBoardConfig", "CSVConfig", "WandbConfig", "get_monitor_config",
           "Monitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor", "CometMonitor"]

TensorBoardConfig = CSVConfig = MonitorConfig  # DeepSpeed's names of the two file writers' blocks
CometMonitor = refused_class("deepspeed.monitor.comet.CometMonitor")

Event = tuple[str, float, int]  # (tag, value, step): DeepSpeed's (and tensorboard's add_scalar's) order


def _section(model: type[MonitorConfig] | type[WandbConfig], block: Any, key: str) -> Any:
    if block is None:
        return model()
    if isinstance(block, model):
        return block
    if isinstance(block, Mapping):
        return model.model_validate(dict(block))
    raise TypeError(f"monitor config '{key}': expected a dict or {model.__name__}, got {type(block).__name__}")


class DeepSpeedMonitorConfig:
    """The ``tensorboard``, ``wandb`` and ``csv_monitor`` blocks (dicts or zerotune's sections) and whether any is on.

    A ``comet`` block is accepted disabled (it changes nothing) and refused enabled, as the engine's config."""

    def __init__(self, tensorboard: Any = None, wandb: Any = None, csv_monitor: Any = None,
                 comet: Any = None) -> None:
        self.tensorboard: MonitorConfig = _section(MonitorConfig, tensorboard, "tensorboard")
        self.wandb: WandbConfig = _section(WandbConfig, wandb, "wandb")
        self.csv_monitor: MonitorConfig = _section(MonitorConfig, csv_monitor, "csv_monitor")
        comet_on = comet.get("enabled", False) if isinstance(comet, Mapping) else getattr(comet, "enabled", False)
        if comet_on:
            raise DeepSpeedFeatureNotSupported("deepspeed.monitor.comet", "the Comet monitor (comet.enabled)")

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard.enabled or self.wandb.enabled or self.csv_monitor.enabled)


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor blocks of a config dict (absent blocks: their defaults)."""
    return DeepSpeedMonitorConfig(**{key: param_dict.get(key, {}) for key in ("tensorboard", "wandb", "csv_monitor",
                                                                              "comet")})


class Monitor(ABC):
    """DeepSpeed's monitor interface: built from its config block, ``write_events`` of ``(tag, value, step)``."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Iterable[Event]) -> None: ...


class _WriterMonitor(Monitor):
    """One backend of zerotune's ``ScalarWriters``: it opens its files or run on rank 0 only, when enabled."""

    def __init__(self, monitor_config: Any, backend: str) -> None:
        super().__init__(monitor_config)
        self.enabled = bool(monitor_config.enabled)
        self.writers = ScalarWriters.from_config(**{"tensorboard": None, "csv_monitor": None, "wandb": None,
                                                    backend: monitor_config}, rank=get_rank())

    def write_events(self, event_list: Iterable[Event], flush: bool = True) -> None:
        for tag, value, step in event_list:
            self.writers.write(int(step), {tag: float(value)})
        if flush:
            self.writers.flush()

    def flush(self) -> None:
        self.writers.flush()

    def close(self) -> None:
        self.writers.close()


class TensorBoardMonitor(_WriterMonitor):
    """Scalars into a tensorboard event file under ``output_path/job_name`` (``tensorboard`` block)."""

    def __init__(self, tensorboard_config: MonitorConfig) -> None:
        super().__init__(tensorboard_config, "tensorboard")
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name


class csvMonitor(_WriterMonitor):  # noqa: N801 - DeepSpeed's name
    """One CSV file per tag under ``output_path/job_name`` (``csv_monitor`` block)."""

    def __init__(self, csv_config: MonitorConfig) -> None:
        super().__init__(csv_config, "csv_monitor")
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = next((sink.log_dir for sink in self.writers.sinks if isinstance(sink, CsvSink)), None)


class WandbMonitor(_WriterMonitor):
    """A Weights & Biases run (``team`` -> entity, ``group``, ``project``) logging by step (``wandb`` block); the
    package is needed only when enabled."""

    def __init__(self, wandb_config: WandbConfig) -> None:
        super().__init__(wandb_config, "wandb")
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project


class MonitorMaster(Monitor):
    """Every enabled monitor of a ``DeepSpeedMonitorConfig``, built and written on rank 0."""

    def __init__(self, monitor_config: DeepSpeedMonitorConfig) -> None:
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: csvMonitor | None = None
        if get_rank() == 0:
            if monitor_config.tensorboard.enabled:
                self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
            if monitor_config.wandb.enabled:
                self.wandb_monitor = WandbMonitor(monitor_config.wandb)
            if monitor_config.csv_monitor.enabled:
                self.csv_monitor = csvMonitor(monitor_config.csv_monitor)

    def write_events(self, event_list: Iterable[Event]) -> None:
        events = list(event_list)
        for monitor in (self.tb_monitor, self.wandb_monitor, self.csv_monitor):
            if monitor is not None:
                monitor.write_events(events)
