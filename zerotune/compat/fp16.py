"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 optimizer wrappers, as names code can test against.

In DeepSpeed ``engine.optimizer`` is an ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` wrapping the client
optimizer at ZeRO 0 with fp16. zerotune keeps mixed precision (masters, loss scale, unscale) in the engine
and hands out the optimizer on the masters itself, so no engine's optimizer is an instance of these: code
that branches on ``isinstance(engine.optimizer, FP16_Optimizer)`` takes its plain-optimizer path, and
building one directly is refused naming the feature.
"""

from __future__ import annotations

from zerotune.compat.refusals import refused_class

FP16_Optimizer = refused_class("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer")
FP16_UnfusedOptimizer = refused_class("deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer")

__all__ = ["FP16_Optimizer", "FP16_UnfusedOptimizer"]
