"""``engine.tput_timer``: DeepSpeed's ThroughputTimer -- samples per second over optimizer steps.

The engine starts it at each forward and stops it at each ``step()``; a global step (an
accumulation boundary) closes one timed window of ``batch_size`` samples. The first
``start_step`` steps are warm-up and are not counted.
"""

from __future__ import annotations

import time
from typing import Callable


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self._synchronize = synchronize
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._started_at: float | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if self._started_at is None:
            if self._synchronize is not None:
                self._synchronize()
            self._started_at = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if self._started_at is None:
            return
        self.micro_step_count += 1
        if not global_step:
            return
        self.global_step_count += 1
        if self._synchronize is not None:
            self._synchronize()
        elapsed = time.perf_counter() - self._started_at
        self._started_at = None
        self.step_elapsed_time = elapsed
        if self.global_step_count > self.start_step:
            self.total_elapsed_time += elapsed

    def avg_samples_per_sec(self) -> float:
        """Mean samples per second over the counted (post warm-up) steps; 0.0 before any."""
        counted = self.global_step_count - self.start_step
        if counted <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return counted * self.batch_size / self.total_elapsed_time
