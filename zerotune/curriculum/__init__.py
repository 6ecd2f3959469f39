"""Curriculum learning (DeepSpeed's ``deepspeed.runtime.data_pipeline``): difficulty schedules and the
seqlen curriculum that cuts sequences to the scheduled length.

``scheduler.py`` is the schedule (``CurriculumScheduler``, DeepSpeed's API), ``seqlen.py`` applies a length
to a model call or a batch, ``data_sampling.py`` steps per-metric schedules over the engine's data loader
(``data_efficiency``); the engine's side (the legacy ``curriculum_learning`` block in every training
forward, checkpoints) is ``zerotune/engine_curriculum.py``.
"""

from zerotune.curriculum.scheduler import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
