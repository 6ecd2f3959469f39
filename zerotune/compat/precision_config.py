"""``deepspeed.runtime.precision_config``: DeepSpeed's ``fp16`` and ``bf16`` config models.

The engine reads zerotune's own sections (``FP16Config`` / ``BF16Config`` in zerotune/config/sections.py);
these models are the DeepSpeed-shaped views client code builds directly (``DeepSpeedFP16Config(**block)``,
``get_bfloat16_config(ds_config)``). Their defaults are read from zerotune's sections, so the two never
disagree, and ``to_section()`` turns one into the section the engine runs with.

Validation follows DeepSpeed 0.19.5's: ``loss_scale`` must be a finite number >= 0 (a numeric string is read,
a bool refused); ``loss_scale_window`` and ``min_loss_scale`` must be integers (bool, inf, nan and non-numbers
refused) and, only while dynamic scaling is on (``enabled`` and ``loss_scale == 0``), positive: a static scale
or a disabled block never reads them, so unused values are kept as given.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import ValidationInfo, field_validator, model_validator

from zerotune.compat.config_utils import DeepSpeedConfigModel
from zerotune.config import ConfigError
from zerotune.config.section import Section
from zerotune.config.sections import BF16Config, FP16Config

__all__ = ["DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config", "get_bfloat16_config",
           "FP16", "BFLOAT16", "BFLOAT16_OLD", "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT",
           "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE"]

_S = TypeVar("_S", bound=Section)

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # the older key, still read when "bf16" is absent

# The keyword names of DeepSpeed's DynamicLossScaler, as dynamic_loss_scale_args() returns them.
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def _fp16_default(name: str) -> Any:
    return FP16Config.model_fields[name].default


def _bf16_default(name: str) -> Any:
    return BF16Config.model_fields[name].default


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """DeepSpeed's ``fp16`` block: float16 mixed precision with a dynamic (``loss_scale`` 0) or static loss scale."""

    enabled: bool = _fp16_default("enabled")
    """Train with float16 compute and fp32 master weights."""
    auto_cast: bool = _fp16_default("auto_cast")
    """Cast the model inputs to float16 (zerotune's engine always casts floating-point inputs)."""
    loss_scale: float = _fp16_default("loss_scale")
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = _fp16_default("initial_scale_power")
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = _fp16_default("loss_scale_window")
    """Overflow-free steps after which the dynamic scale is doubled."""
    hysteresis: int = _fp16_default("hysteresis")
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: bool = _fp16_default("consecutive_hysteresis")
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: int = int(_fp16_default("min_loss_scale"))
    """The dynamic scale never drops below this value."""
    fp16_master_weights_and_grads: bool = False
    """fp16 master weights (DeepSpeed: with its CPU Adam only); zerotune keeps masters in fp32 and refuses true."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_non_negative(cls, value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError("fp16.loss_scale must be a number, not bool")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"fp16.loss_scale must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"fp16.loss_scale must be a finite number, got {value!r}")
        if number < 0:
            raise ValueError(f"fp16.loss_scale must be >= 0 (0 selects dynamic loss scaling), got {value!r}")
        return number

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _an_integer(cls, value: Any, info: ValidationInfo) -> Any:
        # refused before pydantic's coercion, which would read True as 1 and slip past the positivity check
        key = f"fp16.{info.field_name}"
        if isinstance(value, bool):
            raise ValueError(f"{key} must be an integer, not bool")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite integer, got {value!r}")
        try:
            int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be an integer, got {value!r}") from None
        return value

    @model_validator(mode="after")
    def _positive_while_dynamic(self) -> DeepSpeedFP16Config:
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"fp16.{key} must be > 0 while dynamic loss scaling is on (enabled with "
                                     f"loss_scale 0), got {getattr(self, key)}")
        return self

    def initial_dynamic_scale(self) -> int:
        """The dynamic scaler's first scale, 2**initial_scale_power."""
        return 2 ** self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The keyword arguments of a dynamic loss scaler built from this block (DeepSpeed's names)."""
        return {INITIAL_LOSS_SCALE: self.initial_dynamic_scale(), SCALE_WINDOW: self.loss_scale_window,
                DELAYED_SHIFT: self.hysteresis, CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
                MIN_LOSS_SCALE: self.min_loss_scale}

    def to_section(self) -> FP16Config:
        """zerotune's ``fp16`` section with these values (validated by zerotune's rules, which refuse what the
        engine would not honour, such as ``fp16_master_weights_and_grads: true``)."""
        return _as_section(FP16Config, self, "fp16")


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """DeepSpeed's ``bf16`` (older key ``bfloat16``) block: bfloat16 mixed precision, no loss scaling."""

    enabled: bool = _bf16_default("enabled")
    """Train with bfloat16 compute and fp32 master weights."""
    immediate_grad_update: bool = False
    """DeepSpeed: apply each gradient to its fp32 buffer at once (zerotune always accumulates in fp32 buffers)."""
    check_grad_overflow: bool = _bf16_default("check_grad_overflow")
    """Skip a step whose gradient norm is not finite; false applies it anyway."""
    bf16_master_weights_and_grads: bool = False
    """bf16 master weights and gradients (zerotune keeps them fp32 and refuses true)."""
    bf16_optimizer_states: bool = False
    """bf16 optimizer state (zerotune keeps it fp32 and refuses true)."""

    def to_section(self) -> BF16Config:
        """zerotune's ``bf16`` section with these values (zerotune's rules: see DeepSpeedFP16Config.to_section)."""
        return _as_section(BF16Config, self, "bf16")


def _as_section(section: type[_S], model: DeepSpeedConfigModel, block: str) -> _S:
    """``model``'s values as zerotune's section; a key the section accepts without modelling (NO_EFFECT) must hold a
    value that changes nothing there, else a ConfigError names it."""
    values = model.model_dump()
    for key, (harmless, allowed, why) in section.NO_EFFECT.items():
        value = values.pop(key, None)
        if harmless is not None and not harmless(value):
            raise ConfigError(f"{block}.{key}", f"{value!r} is not supported here (valid: {allowed}; {why})")
    return section.model_validate(values)


def get_float16_config(param_dict: dict[str, Any]) -> DeepSpeedFP16Config:
    """The ``fp16`` block of a DeepSpeed config dict as DeepSpeed's model (defaults when absent)."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))


def get_bfloat16_config(param_dict: dict[str, Any]) -> DeepSpeedBF16Config:
    """The ``bf16`` block (or the older ``bfloat16``) of a DeepSpeed config dict as DeepSpeed's model."""
    block = param_dict.get(BFLOAT16)
    if block is None:
        block = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**block)
