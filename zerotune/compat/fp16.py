"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 optimizer wrappers, as names code can test against.

In DeepSpeed ``engine.optimizer`` is an ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` wrapping the client
optimizer at ZeRO 0 with fp16. zerotune keeps mixed precision (masters, loss scale, unscale) in the engine
and hands out the optimizer on the masters itself, so no engine's optimizer is an instance of these: code
that branches on ``isinstance(engine.optimizer, FP16_Optimizer)`` takes its plain-optimizer path, and
building one directly is refused naming the feature.
"""

from __future__ import annotations

from typing import Any

from zerotune.compat.refusals import refused_class
from zerotune.precision.loss_scaler import DynamicLossScaler, StaticLossScaler

FP16_Optimizer = refused_class("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer")
FP16_UnfusedOptimizer = refused_class("deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer")



class LossScaleConfig:
    """DeepSpeed 0.19's ``optimizer.loss_scale_config``: the engine's loss scaler read through DeepSpeed's
    names (``cur_scale``, ``cur_iter``, ``scale_window``, ``min_loss_scale``, ``dynamic_loss_scale``). A live
    view, not a copy: every step's scale shows."""

    def __init__(self, scaler: StaticLossScaler | DynamicLossScaler) -> None:
        self._scaler = scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        return isinstance(self._scaler, DynamicLossScaler)

    @property
    def cur_scale(self) -> float:
        return self._scaler.cur_scale

    @property
    def cur_iter(self) -> int:
        return self._scaler.cur_iter if isinstance(self._scaler, DynamicLossScaler) else 0

    @property
    def scale_window(self) -> int | None:
        return self._scaler.scale_window if isinstance(self._scaler, DynamicLossScaler) else None

    @property
    def min_loss_scale(self) -> float:
        return self._scaler.min_scale if isinstance(self._scaler, DynamicLossScaler) else self._scaler.cur_scale

    def __repr__(self) -> str:
        return f"LossScaleConfig({self._scaler!r})"

    def __getattr__(self, name: str) -> Any:  # DeepSpeed's other names that zerotune's scaler shares
        return getattr(self.__dict__["_scaler"], name)


__all__ = ["FP16_Optimizer", "FP16_UnfusedOptimizer", "LossScaleConfig"]
