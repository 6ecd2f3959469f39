"""``DeepSpeedZeROOptimizer(model, optimizer, zero_config)``: a ZeRO optimizer driven like a torch one.

DeepSpeed's older way to use ZeRO without the engine loop (a ZeRO optimizer wrapping a torch one)::

    optimizer = DeepSpeedZeROOptimizer(model, torch.optim.AdamW(model.parameters()), zero_config)
    for batch in data:
        optimizer.zero_grad()
        loss = model(batch)
        optimizer.backward(loss)       # or loss.backward() (fp32 / bf16)
        optimizer.step()

It is a thin driver over the engine ``zerotune.initialize`` builds for ``model`` with ``zero_config``
(the ``zero_optimization`` section, or a whole config): the optimizer steps on the rank's shards,
gradients are reduced as the stage says, and ``model`` itself is the engine's module (call it as
before). One optimizer step per ``step()`` (no gradient accumulation).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeepSpeedZeROOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]

_WHOLE_CONFIG_KEYS = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer",
                      "fp16", "bf16", "gradient_clipping"}


def _config_of(zero_config: Any) -> dict:
    if hasattr(zero_config, "model_dump"):
        zero_config = zero_config.model_dump()
    if not isinstance(zero_config, dict):
        raise TypeError(f"DeepSpeedZeROOptimizer: zero_config must be a dict (the zero_optimization section or a "
                        f"whole config), got {type(zero_config).__name__}")
    config = dict(zero_config) if _WHOLE_CONFIG_KEYS & set(zero_config) else {"zero_optimization": dict(zero_config)}
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config.setdefault("gradient_accumulation_steps", 1)
    if config["gradient_accumulation_steps"] != 1:
        raise ValueError("DeepSpeedZeROOptimizer steps on every step(): gradient_accumulation_steps must be 1; use "
                         "zerotune.initialize for accumulation")
    config.setdefault("steps_per_print", 10**9)
    return config


class _ZeroOptimizerClass(type):
    """``isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)`` (or ``DeepSpeedZeroOptimizer`` for stages 1-2) also
    holds for the optimizer ``initialize`` returned from an engine of that ZeRO stage: DeepSpeed returns its ZeRO
    optimizer there, zerotune the torch optimizer with DeepSpeed's attributes on it (``compat/spellings.py``
    marks it). A virtual subclass, as ``abc``'s ``register`` makes one."""

    def __instancecheck__(cls, instance: Any) -> bool:
        stages: tuple[int, ...] = getattr(cls, "ZERO_STAGES", ())
        return super().__instancecheck__(instance) or getattr(instance, "_zerotune_zero_stage", None) in stages


class DeepSpeedZeROOptimizer(metaclass=_ZeroOptimizerClass):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, zero_config: Any,
                 **initialize_kwargs: Any) -> None:
        from zerotune.initialize import initialize

        self.engine, self.optimizer, _, self.lr_scheduler = initialize(
            model=model, optimizer=optimizer, config=_config_of(zero_config), **initialize_kwargs)
        self.module = self.engine.module
        self._through_backward = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.engine.get_loss_scale()

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients and open the next backward's reduction (so ``loss.backward()`` works too)."""
        self.engine.zero_grad(set_to_none)
        self.engine.state.begin_micro_step(True)
        self._through_backward = False

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward with the fp16 loss scale applied (needed in fp16; ``loss.backward()`` is fine otherwise)."""
        self.engine.backward(loss, retain_graph=retain_graph)
        self._through_backward = True

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("DeepSpeedZeROOptimizer.step() takes no closure")
        if self.engine.fp16_enabled() and not self._through_backward:
            raise RuntimeError("fp16: call optimizer.backward(loss) (it applies the loss scale) instead of "
                               "loss.backward()")
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        self._through_backward = False

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class DeepSpeedZeroOptimizer(DeepSpeedZeROOptimizer):
    """DeepSpeed's ZeRO 1/2 optimizer class name: the same driver (any stage the config asks for)."""

    ZERO_STAGES = (1, 2)


class DeepSpeedZeroOptimizer_Stage3(DeepSpeedZeROOptimizer):  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's ZeRO-3 optimizer class name: the same driver (any stage the config asks for)."""

    ZERO_STAGES = (3,)
