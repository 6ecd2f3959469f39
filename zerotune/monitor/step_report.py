"""One log line per ``steps_per_print`` optimizer steps, and scalars for every step.

DeepSpeed prints a line for every fp16 overflow; during loss-scale warm-up that floods
the console with near-identical lines. Here skipped steps are counted and summarised in
the window's single line, together with how the loss scale moved.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from zerotune.monitor.logging import get_logger
from zerotune.monitor.timers import WallClockTimers
from zerotune.monitor.writers import ScalarWriters

SCALAR_PREFIX = "Train/Samples/"


def _format_scale(scale: float) -> str:
    """65536.0 -> "65536"; non-integral scales keep their digits."""
    if math.isfinite(scale) and scale == int(scale):
        return str(int(scale))
    return f"{scale:g}"


class StepReporter:
    """Collects per-step numbers on rank 0 and emits ONE log line every ``steps_per_print`` steps.

    The line holds: step, mean loss over the window, lr, grad norm, loss scale (fp16),
    samples/s, a summary of skipped (overflowed) steps, and -- when the timers are
    enabled -- the mean time per call of each timer. Samples/s is measured from the
    previous line (from construction for the first one), so build the reporter right
    before the training loop.
    """

    def __init__(
        self,
        steps_per_print: int,
        rank: int,
        writers: ScalarWriters | None,
        timers: WallClockTimers | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(steps_per_print, int) or steps_per_print < 1:
            raise ValueError(f"steps_per_print must be a positive integer, got {steps_per_print!r}")
        self.steps_per_print = steps_per_print
        self.rank = rank
        self.writers = writers
        self.timers = timers
        self._clock = clock
        self._window_started_at = clock()
        # The scale in effect when the window began: the last scale of the previous
        # window, or (first window) the first scale recorded.
        self._scale_at_start: float | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._loss_sum = 0.0
        self._loss_count = 0
        self._samples = 0
        self._skipped = 0

    def record(
        self,
        *,
        step: int,
        loss: float | None,
        lr: float,
        grad_norm: float | None,
        loss_scale: float | None,
        samples: int,
        skipped: bool,
    ) -> None:
        """Account one optimizer step (accumulation boundary); values are python floats.

        ``loss_scale`` is the scale in effect after this step's update (the lowered one
        after an overflow); ``None`` when not training in fp16.
        """
        if self.rank != 0:
            return
        if loss is not None:
            self._loss_sum += loss
            self._loss_count += 1
        self._samples += samples
        if skipped:
            self._skipped += 1
        if loss_scale is not None and self._scale_at_start is None:
            self._scale_at_start = loss_scale
        if self.writers is not None:
            self.writers.write(step, self._step_scalars(loss, lr, grad_norm, loss_scale))
        if step % self.steps_per_print == 0:
            self._emit(step, lr, grad_norm, loss_scale)

    @staticmethod
    def _step_scalars(
        loss: float | None, lr: float, grad_norm: float | None, loss_scale: float | None
    ) -> dict[str, float]:
        scalars = {SCALAR_PREFIX + "lr": lr}
        if loss is not None:
            scalars[SCALAR_PREFIX + "train_loss"] = loss
        if grad_norm is not None:
            scalars[SCALAR_PREFIX + "grad_norm"] = grad_norm
        if loss_scale is not None:
            scalars[SCALAR_PREFIX + "loss_scale"] = loss_scale
        return scalars

    def _emit(self, step: int, lr: float, grad_norm: float | None, loss_scale: float | None) -> None:
        now = self._clock()
        elapsed_s = now - self._window_started_at
        parts = [f"step {step}"]
        if self._loss_count:
            parts.append(f"loss {self._loss_sum / self._loss_count:.4f}")
        parts.append(f"lr {lr:.3e}")
        if grad_norm is not None:
            parts.append(f"grad norm {grad_norm:.4g}")
        if loss_scale is not None:
            parts.append(f"loss scale {_format_scale(loss_scale)}")
        if elapsed_s > 0:
            parts.append(f"{self._samples / elapsed_s:.1f} samples/s")
        if self._skipped:
            parts.append(self._skipped_summary(loss_scale))
        timers = self.timers
        means = timers.window_means_ms(reset=True) if timers is not None else {}
        if timers is not None and means:
            parts.append(timers.format(means))
            if self.writers is not None:
                self.writers.write(step, {f"{SCALAR_PREFIX}elapsed_time_ms_{name}": ms for name, ms in means.items()})
        get_logger().info(" | ".join(parts))
        if self.writers is not None:
            self.writers.flush()
        self._window_started_at = now
        self._scale_at_start = loss_scale
        self._reset_window()

    def _skipped_summary(self, loss_scale: float | None) -> str:
        noun = "step" if self._skipped == 1 else "steps"
        why = "fp16 overflow" if loss_scale is not None else "non-finite gradient norm"  # (loss_scale: fp16 only)
        summary = f"skipped {self._skipped} {noun} ({why}) in this window"
        if loss_scale is not None and self._scale_at_start is not None and loss_scale != self._scale_at_start:
            summary += f", loss scale {_format_scale(self._scale_at_start)} -> {_format_scale(loss_scale)}"
        return summary
