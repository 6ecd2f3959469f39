"""``CurriculumScheduler``: the difficulty of each training step, with DeepSpeed's API.

The schedule is a pure function of the step (``get_difficulty``); the scheduler remembers the difficulty
reached (``update_difficulty``), which stops changing once it gets to ``max_difficulty`` -- DeepSpeed's
rule, which is why a custom schedule that comes back down after reaching the maximum stays there.

The four schedules (``schedule_config`` holds their parameters):

* ``fixed_linear`` / ``fixed_root``: ``min + (max - min) * (step / total_curriculum_step) ** (1 / root_degree)``
  (root_degree 1 for linear), rounded down to a multiple of ``difficulty_step`` but never below the first
  such multiple at or above ``min_difficulty`` (a seqlen of 0 would be an empty batch), and never above
  ``max_difficulty``;
* ``fixed_discrete``: ``difficulty[i]`` for steps up to ``max_step[i]``, the last difficulty afterwards;
* ``custom``: the function the script sets (``set_custom_get_difficulty``), called with the step.

The state (``get_state`` / ``set_state``) is DeepSpeed's plain dict -- min, max and current difficulty,
schedule type and config -- so it goes into checkpoints as is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

from zerotune.config.curriculum_section import SCHEDULE_KEYS, validated_schedule
from zerotune.config.errors import ConfigError


class CurriculumScheduler:
    """The difficulty schedule of one curriculum (DeepSpeed's ``CurriculumScheduler``).

    ``config`` is DeepSpeed's dict: ``min_difficulty``, ``max_difficulty``, ``schedule_type`` and its
    ``schedule_config``; other keys of the block it comes from (``enabled``, ``curriculum_type``) are ignored.
    It is checked like the config file (one ``ConfigError`` naming the key)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        schedule = validated_schedule(config, "CurriculumScheduler(config)")
        kind = schedule.schedule_type
        if kind is None:
            raise ConfigError("CurriculumScheduler(config).schedule_type",
                              "required key is missing (a curriculum needs min_difficulty, max_difficulty and "
                              "schedule_type)")
        self.state: dict[str, Any] = {
            "min_difficulty": schedule.min_difficulty,
            "max_difficulty": schedule.max_difficulty,
            "current_difficulty": schedule.min_difficulty,
            "schedule_type": kind,
            "schedule_config": {key: getattr(schedule.schedule_config, key) for key in SCHEDULE_KEYS[kind]},
        }
        self.custom_get_difficulty: Callable[[int], int] | None = None

    # ---- DeepSpeed's API ----------------------------------------------------------------
    def get_current_difficulty(self) -> int:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The ``custom`` schedule: ``schedule_function(global_steps) -> difficulty``."""
        if not callable(schedule_function):
            raise TypeError(f"set_custom_get_difficulty expects a function of the step, got "
                            f"{type(schedule_function).__name__}")
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at ``global_steps`` (steps count from 1)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._root(global_steps, 1.0)
        if kind == "fixed_root":
            return self._root(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError("curriculum schedule_type 'custom' has no schedule: call "
                               "engine.set_custom_curriculum_learning_schedule(fn) (or the scheduler's "
                               "set_custom_get_difficulty(fn)) before the first training step")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move to the difficulty of ``global_steps`` unless ``max_difficulty`` was already reached."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    # ---- the schedules ------------------------------------------------------------------
    def _discrete(self, step: int) -> int:
        config = self.state["schedule_config"]
        for last_step, difficulty in zip(config["max_step"], config["difficulty"]):
            if step <= last_step:
                return difficulty
        return config["difficulty"][-1]

    def _root(self, step: int, degree: float) -> int:
        config = self.state["schedule_config"]
        low, high, multiple = self.state["min_difficulty"], self.state["max_difficulty"], config["difficulty_step"]
        progress = (step / config["total_curriculum_step"]) ** (1.0 / degree)
        difficulty = math.floor(low + progress * (high - low))
        difficulty -= difficulty % multiple
        first_multiple = -(-low // multiple) * multiple  # the smallest multiple of difficulty_step >= min_difficulty
        return min(max(difficulty, first_multiple), high)


__all__ = ["CurriculumScheduler"]
