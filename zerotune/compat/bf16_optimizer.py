"""``deepspeed.runtime.bf16_optimizer``: DeepSpeed's bf16 optimizer wrapper, as a name code can test against.

DeepSpeed wraps the client optimizer in a ``BF16_Optimizer`` (fp32 master copies and flat fp32 gradient buffers)
for bf16 at ZeRO stage 1 with fp32 gradient accumulation, and for bf16 pipelines. zerotune keeps bf16's fp32
masters and gradient accumulation in the engine (``precision/``) and hands out the optimizer on the masters
itself, so, as with ``FP16_Optimizer`` (``compat/fp16.py``), no engine's optimizer is an instance of it: code that
branches on ``isinstance(engine.optimizer, BF16_Optimizer)`` takes its plain-optimizer path, and building one
directly is refused naming the feature.
"""

from __future__ import annotations

from zerotune.compat.refusals import refused_class

BF16_Optimizer = refused_class("deepspeed.runtime.bf16_optimizer.BF16_Optimizer")

__all__ = ["BF16_Optimizer"]
