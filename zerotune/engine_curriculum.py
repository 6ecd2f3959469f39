"""The engine's side of curriculum learning, with DeepSpeed's names.

The legacy ``curriculum_learning`` block acts in every training forward of ``Engine`` (``engine.py`` calls
``_curriculum_inputs``): the scheduler moves to the difficulty of step ``global_steps + 1`` and, as it is a
seqlen curriculum, the model gets ``curriculum_seqlen=<difficulty>`` when its forward has that parameter
(Megatron-style models cut their own sequences), else the call's sequence tensors are cut to that length
(``curriculum/seqlen.py``), so a Hugging Face model trains on the scheduled lengths unchanged. Evaluation
forwards (module in eval mode) are left alone, as in DeepSpeed. The pipeline engine does not apply it
(DeepSpeed's does not either: a Megatron pipeline script steps ``curriculum_scheduler_legacy`` itself).

The ``data_efficiency`` curriculum lives on the engine's data loader (``curriculum/data_sampling.py``).
Both curricula's positions go into checkpoints (``curriculum_state``), so a resumed run continues at the
difficulty it reached.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from zerotune.curriculum.data_sampling import DataCurriculum
from zerotune.curriculum.scheduler import CurriculumScheduler
from zerotune.curriculum.seqlen import CURRICULUM_KWARG, cut_sequences, takes_curriculum_seqlen
from zerotune.monitor.logging import log_rank0

if TYPE_CHECKING:
    from zerotune.config.schema import ZeroTuneConfig
    from zerotune.engine_data import EngineDataLoader


class EngineCurriculum:
    """Mixed into ``EngineCore``; relies on the engine's attributes declared below. The scheduler is built on first
    use from the config (it is pure and cheap)."""

    _legacy_scheduler: CurriculumScheduler | None = None
    _passes_curriculum_kwarg: bool | None = None  # decided at the first training forward

    if TYPE_CHECKING:  # set by EngineCore.__init__, or EngineQueries' properties
        _config: ZeroTuneConfig
        module: torch.nn.Module
        global_steps: int
        training_dataloader: EngineDataLoader | None

        @property
        def global_rank(self) -> int: ...

    # ---- DeepSpeed's accessors -----------------------------------------------------------
    def curriculum_enabled_legacy(self) -> bool:
        return bool(self._config.curriculum_learning.enabled)

    def curriculum_params_legacy(self) -> dict[str, Any] | bool:
        """The ``curriculum_learning`` block without ``enabled`` (False when the config has none), as DeepSpeed."""
        if "curriculum_learning" not in self._config.model_fields_set:
            return False
        return self._legacy_params()

    def _legacy_params(self) -> dict[str, Any]:
        params = self._config.curriculum_learning.model_dump(exclude_none=True)
        params.pop("enabled")
        return params

    @property
    def curriculum_scheduler_legacy(self) -> CurriculumScheduler | None:
        """The legacy block's scheduler (None when the block is off)."""
        if self._legacy_scheduler is None and self.curriculum_enabled_legacy():
            self._legacy_scheduler = CurriculumScheduler(self._legacy_params())
        return self._legacy_scheduler

    def data_efficiency_enabled(self) -> bool:
        return bool(self._config.data_efficiency.enabled)

    def curriculum_learning_enabled(self) -> bool:
        """Whether the ``data_efficiency`` curriculum is on (DeepSpeed's name for the non-legacy one)."""
        return bool(self._config.data_efficiency.data_sampling.curriculum_learning.enabled)

    @property
    def _data_curriculum(self) -> DataCurriculum | None:
        return getattr(self.training_dataloader, "curriculum", None)

    def set_custom_curriculum_learning_schedule(self, schedule: Callable[[int], int] | dict[str, Callable]) -> None:
        """The ``custom`` schedule: a function of the step for the legacy block, or ``{metric: function}`` for
        ``data_efficiency``'s metrics (DeepSpeed's form)."""
        if isinstance(schedule, dict):
            if self._data_curriculum is None:
                raise ValueError("set_custom_curriculum_learning_schedule({metric: fn}) needs the data_efficiency "
                                 "curriculum on the engine's data loader (initialize(training_data=...) with "
                                 "data_efficiency.data_sampling.curriculum_learning enabled)")
            self._data_curriculum.set_custom_schedules(schedule)
            return
        scheduler = self.curriculum_scheduler_legacy
        if scheduler is None:
            raise ValueError("set_custom_curriculum_learning_schedule(fn) needs curriculum_learning.enabled with "
                             "schedule_type 'custom' in the config")
        if scheduler.state["schedule_type"] != "custom":
            log_rank0("set_custom_curriculum_learning_schedule: no effect, curriculum_learning.schedule_type is %s "
                      "(the function is used with 'custom')", scheduler.state["schedule_type"],
                      rank=self.global_rank, level=logging.WARNING)
        scheduler.set_custom_get_difficulty(schedule)

    # ---- the forward hook ----------------------------------------------------------------
    def _curriculum_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A training forward's inputs under the legacy seqlen curriculum (unchanged without it)."""
        scheduler = self.curriculum_scheduler_legacy
        if scheduler is None or not self.module.training:
            return args, kwargs
        seqlen = scheduler.update_difficulty(self.global_steps + 1)
        if self._passes_curriculum_kwarg is None:
            self._passes_curriculum_kwarg = takes_curriculum_seqlen(self.module)
            log_rank0("curriculum_learning: seqlen %s from %d to %d tokens; %s", scheduler.state["schedule_type"],
                      scheduler.state["min_difficulty"], scheduler.state["max_difficulty"],
                      f"the model's forward gets {CURRICULUM_KWARG}=" if self._passes_curriculum_kwarg else
                      "the batch's sequence tensors are cut to that length (the model's forward takes no "
                      f"{CURRICULUM_KWARG})", rank=self.global_rank)
        if self._passes_curriculum_kwarg:
            return args, {**kwargs, CURRICULUM_KWARG: seqlen}
        return cut_sequences(args, kwargs, seqlen)

    # ---- checkpoints ---------------------------------------------------------------------
    def curriculum_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of both curricula: the legacy scheduler's state, the data loader's position."""
        state: dict[str, Any] = {}
        if self.curriculum_scheduler_legacy is not None:
            state["legacy"] = dict(self.curriculum_scheduler_legacy.get_state())
        if self._data_curriculum is not None:
            state["data_sampling"] = self._data_curriculum.state_dict()
        return state

    def load_curriculum_state(self, saved: dict[str, Any] | None) -> None:
        """Continue at the saved difficulties; the schedules themselves come from this run's config."""
        saved = saved or {}
        if self.curriculum_scheduler_legacy is not None and "legacy" in saved:
            self.curriculum_scheduler_legacy.set_current_difficulty(saved["legacy"]["current_difficulty"])
        if self._data_curriculum is not None and "data_sampling" in saved:
            self._data_curriculum.load_state_dict(saved["data_sampling"])


def curriculum_notes(cfg: Any, *, pipelined: bool, has_training_data: bool) -> list[str]:
    """What ``initialize`` reports about a curriculum this run will not apply."""
    notes = []
    if pipelined and cfg.curriculum_learning.enabled:
        notes.append("curriculum_learning: the pipeline engine does not apply it (DeepSpeed's does not either); a "
                     "pipeline script steps engine.curriculum_scheduler_legacy and cuts its sequences itself")
    if not has_training_data and cfg.data_efficiency.data_sampling.curriculum_learning.enabled:
        notes.append("data_efficiency curriculum_learning: no effect, it acts on the engine's data loader and "
                     "initialize got no training_data")
    return notes


__all__ = ["EngineCurriculum", "curriculum_notes"]
