"""``data_efficiency.data_sampling.curriculum_learning`` over the engine's data loader.

DeepSpeed's data sampler advances each metric's schedule once per global batch it draws
(``curriculum_step``) and hands the difficulties to the data post-process function as
``state["current_difficulties"]``; with ``single_cluster`` clustering (the only kind that needs no
offline data analyzer) it selects no samples by difficulty, so the post-process function is where a
curriculum acts. zerotune keeps that contract on its loader (``engine_data.EngineDataLoader``): the
loader's own sample order, one schedule step per ``gradient_accumulation_steps`` micro-batches, the
function called with the difficulties. When no function is set, the metric named ``seqlen`` cuts the batch's
sequence tensors itself (``seqlen.cut_batch``), and any other metric is reported once as having no effect.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from zerotune.config.curriculum_section import DataEfficiencyConfig
from zerotune.curriculum.scheduler import CurriculumScheduler
from zerotune.curriculum.seqlen import cut_batch
from zerotune.monitor.logging import log_rank0

SEQLEN_METRIC = "seqlen"


class DataCurriculum:
    """Each metric's schedule, stepped by the batches the loader yields (``next_batch``)."""

    def __init__(self, metrics: dict[str, dict[str, Any]], gradient_accumulation_steps: int, rank: int = 0) -> None:
        self.rank = rank
        self.schedulers = {name: CurriculumScheduler(config) for name, config in metrics.items()}
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.curriculum_step = 0  # global batches drawn (DeepSpeed's name)
        self.micro_batches = 0
        self.current_difficulties: dict[str, int] = {}
        self._reported_idle = False

    @classmethod
    def from_config(cls, section: DataEfficiencyConfig, gradient_accumulation_steps: int,
                    rank: int) -> "DataCurriculum | None":
        """The curriculum the section asks for, or None when it is off (the config refuses an enabled curriculum
        inside a disabled block, so the innermost switch decides)."""
        curriculum = section.data_sampling.curriculum_learning
        if not curriculum.enabled:
            return None
        metrics = {name: metric.model_dump(exclude_none=True) for name, metric in curriculum.curriculum_metrics.items()}
        return cls(metrics, gradient_accumulation_steps, rank)

    def next_batch(self) -> dict[str, Any]:
        """Count one micro-batch; the first of each global batch advances every schedule. Returns the state
        the post-process function receives."""
        if self.micro_batches % self.gradient_accumulation_steps == 0:
            self.curriculum_step += 1
            self.current_difficulties = {name: scheduler.update_difficulty(self.curriculum_step)
                                         for name, scheduler in self.schedulers.items()}
        self.micro_batches += 1
        return self.state_dict()

    def apply(self, batch: Any, post_process_func: Callable | None) -> Any:
        """Without a post-process function: the seqlen metric cuts the batch; other metrics have no effect
        (reported once). With one, the batch is the function's business (DeepSpeed's contract)."""
        if post_process_func is not None:
            return batch
        idle = sorted(name for name in self.schedulers if name != SEQLEN_METRIC)
        if idle and not self._reported_idle:
            self._reported_idle = True
            log_rank0("data_efficiency curriculum metric(s) %s have no effect: no data post-process function is set "
                      "(engine.set_data_post_process_func) to act on their difficulty; only the 'seqlen' metric acts "
                      "by itself", idle, rank=self.rank, level=logging.WARNING)
        if SEQLEN_METRIC in self.current_difficulties:
            return cut_batch(batch, self.current_difficulties[SEQLEN_METRIC])
        return batch

    def set_custom_schedules(self, schedules: dict[str, Callable[[int], int]]) -> None:
        """``{metric: fn}`` for the metrics whose schedule_type is custom (DeepSpeed's dict form)."""
        unknown = sorted(set(schedules) - set(self.schedulers))
        if unknown:
            raise ValueError(f"set_custom_curriculum_learning_schedule: no curriculum metric named {unknown}; the "
                             f"config's curriculum_metrics are {sorted(self.schedulers)}")
        for name, function in schedules.items():
            self.schedulers[name].set_custom_get_difficulty(function)

    def state_dict(self) -> dict[str, Any]:
        return {"curriculum_step": self.curriculum_step, "micro_batches": self.micro_batches,
                "current_difficulties": dict(self.current_difficulties),
                "schedulers": {name: dict(s.get_state()) for name, s in self.schedulers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: the step count and each metric's difficulty reached (the schedules
        themselves come from this run's config)."""
        self.curriculum_step, self.micro_batches = state["curriculum_step"], state["micro_batches"]
        self.current_difficulties = dict(state["current_difficulties"])
        for name, saved in state["schedulers"].items():
            if name in self.schedulers:
                self.schedulers[name].set_current_difficulty(saved["current_difficulty"])


__all__ = ["DataCurriculum", "SEQLEN_METRIC"]
