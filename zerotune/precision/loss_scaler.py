"""fp16 loss scaling with DeepSpeed's semantics.

fp16 has 5 exponent bits, so small gradients underflow to zero. Multiplying the loss by a large
scale before backward keeps them representable; the optimizer sees them divided back. A
dynamic scaler halves the scale when a step overflows (and skips that step) and doubles it
at the step after ``loss_scale_window`` clean ones (DeepSpeed 0.19's count). ``hysteresis`` lets
a few overflows pass before the first halving -- DeepSpeed's "delayed shift".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class LossScaleError(FloatingPointError):
    """Overflow while the scale is already at its minimum: training cannot make progress."""


class NonFiniteError(FloatingPointError):
    """Too many optimizer steps in a row had a non-finite gradient norm: the run would go on with garbage."""


@dataclass
class StaticLossScaler:
    """A fixed scale (``fp16.loss_scale`` > 0, or 1.0 for fp32/bf16). Overflowing steps are still skipped."""

    cur_scale: float = 1.0
    dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        del overflow

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = state["cur_scale"]


@dataclass
class DynamicLossScaler:
    """DeepSpeed's DynamicLossScaler, field for field (so checkpoints and logs read the same)."""

    cur_scale: float = 2.0**16
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 2
    consecutive_hysteresis: bool = False
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2
    dynamic = True

    @classmethod
    def from_config(cls, *, initial_scale_power: int, loss_scale_window: int, min_loss_scale: float,
                    hysteresis: int, consecutive_hysteresis: bool) -> DynamicLossScaler:
        return cls(cur_scale=2.0**initial_scale_power, scale_window=loss_scale_window, min_scale=min_loss_scale,
                   delayed_shift=hysteresis, consecutive_hysteresis=consecutive_hysteresis,
                   cur_hysteresis=hysteresis)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def at_minimum(self) -> bool:
        return self.cur_scale <= self.min_scale

    def update_scale(self, overflow: bool) -> None:
        """Advance one optimizer step (skipped or not)."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            clean_before = self.cur_iter - self.last_overflow_iter - 1  # clean steps since the last overflow
            if clean_before > 0 and clean_before % self.scale_window == 0:  # (DeepSpeed >= 0.19's count)
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
