"""Scalar sinks configured by DeepSpeed's ``tensorboard``, ``csv_monitor`` and ``wandb`` blocks.

Only rank 0 opens files or runs: every rank holds the same reduced scalars, so N writers
would produce N identical copies. The availability of optional packages is checked on
every rank, though, so a missing package fails all ranks the same way instead of
killing rank 0 and leaving the others waiting in a collective.
"""

from __future__ import annotations

import csv
import os
from typing import IO, Any, Mapping, Protocol

DEFAULT_OUTPUT_PATH = "./runs"
DEFAULT_JOB_NAME = "DeepSpeedJobName"
DEFAULT_WANDB_PROJECT = "deepspeed"


class _Sink(Protocol):
    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def _field(block: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a config block given as an object with attributes or as a dict."""
    if block is None:
        return default
    if isinstance(block, Mapping):
        return block.get(name, default)
    return getattr(block, name, default)


def _log_dir(block: Any) -> str:
    """``output_path/job_name``, with DeepSpeed's defaults for empty values."""
    output_path = _field(block, "output_path") or DEFAULT_OUTPUT_PATH
    job_name = _field(block, "job_name") or DEFAULT_JOB_NAME
    return os.path.join(output_path, job_name)


class TensorBoardSink:
    """One ``SummaryWriter`` event file under ``output_path/job_name``."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, float(value), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def csv_file_name(scalar_name: str) -> str:
    """DeepSpeed's file name for a scalar: ``Train/Samples/lr`` -> ``Train_Samples_lr.csv``."""
    return scalar_name.replace("/", "_").replace(" ", "_") + ".csv"


class CsvSink:
    """DeepSpeed's csv_monitor layout: one file per scalar, header ``step,<last name part>``.

    Unlike DeepSpeed, the header is written only when the file is new, so a resumed run
    appends rows to the same file instead of inserting a second header mid-file. Files
    stay open and line-buffered: a row reaches the disk when written, without reopening
    a file per scalar per step.
    """

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._files: dict[str, tuple[IO[str], Any]] = {}

    def _writer_for(self, scalar_name: str) -> Any:
        if scalar_name not in self._files:
            path = os.path.join(self.log_dir, csv_file_name(scalar_name))
            is_new = not os.path.exists(path) or os.path.getsize(path) == 0
            handle = open(path, "a", newline="", buffering=1)
            writer = csv.writer(handle)
            if is_new:
                writer.writerow(["step", scalar_name.split("/")[-1]])
            self._files[scalar_name] = (handle, writer)
        return self._files[scalar_name][1]

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer_for(name).writerow([step, float(value)])

    def flush(self) -> None:
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "wandb.enabled is true but the wandb package is not installed; pip install wandb or disable it "
            "(zerotune's extra: pip install 'zerotune[wandb]')"
        ) from error
    return wandb


class WandbSink:
    """A wandb run (``team`` -> entity, ``group``, ``project``) logging scalars by step."""

    def __init__(self, wandb_module: Any, *, team: str | None, group: str | None, project: str) -> None:
        self._wandb = wandb_module
        self._run = wandb_module.init(project=project, group=group, entity=team)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({name: float(value) for name, value in scalars.items()}, step=step)

    def flush(self) -> None:
        """wandb streams in a background process; there is nothing to flush."""

    def close(self) -> None:
        self._run.finish()


def check_writer_packages(tensorboard: Any = None, wandb: Any = None) -> None:
    """ImportError naming the block and the package when an enabled writer's package is missing: callers
    check at start (``zerotune finetune`` before loading a model) rather than when the engine is built."""
    if bool(_field(wandb, "enabled", False)):
        _import_wandb()
    if bool(_field(tensorboard, "enabled", False)):
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "tensorboard.enabled is true but the tensorboard package is not installed; "
                "pip install tensorboard or disable it"
            ) from error


class ScalarWriters:
    """Fans scalars out to the configured sinks. Only rank 0 writes."""

    def __init__(self, sinks: list[_Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def from_config(cls, tensorboard: Any, csv_monitor: Any, wandb: Any, *, rank: int) -> ScalarWriters:
        """Build sinks from DeepSpeed-style blocks (objects or dicts; ``None`` = block absent)."""
        tensorboard_on = bool(_field(tensorboard, "enabled", False))
        csv_on = bool(_field(csv_monitor, "enabled", False))
        wandb_on = bool(_field(wandb, "enabled", False))
        # Import checks run on every rank (see the module docstring).
        check_writer_packages(tensorboard, wandb)
        wandb_module = _import_wandb() if wandb_on else None
        if rank != 0:
            return cls([])
        sinks: list[_Sink] = []
        if tensorboard_on:
            sinks.append(TensorBoardSink(_log_dir(tensorboard)))
        if csv_on:
            sinks.append(CsvSink(_log_dir(csv_monitor)))
        if wandb_on:
            sinks.append(
                WandbSink(
                    wandb_module,
                    team=_field(wandb, "team"),
                    group=_field(wandb, "group"),
                    project=_field(wandb, "project") or DEFAULT_WANDB_PROJECT,
                )
            )
        return cls(sinks)

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Write ``{"Train/Samples/train_loss": 2.3, ...}`` at ``step`` to every sink."""
        for sink in self.sinks:
            sink.write(step, scalars)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
