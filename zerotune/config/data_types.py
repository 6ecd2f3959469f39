"""``data_types``: DeepSpeed's choice of the gradient-accumulation dtype, and which choices exist.

zerotune always sums gradients over micro-steps in fp32 buffers (``zerotune.zero.allreduce_sync``), so
``grad_accum_dtype`` changes no number here: a ``bf16`` / ``fp16`` value, which saves memory in DeepSpeed,
is reported as having no effect. The combinations DeepSpeed refuses are refused the same way (a
``NotImplementedError``), so a config that fails under DeepSpeed does not start a run here: without ZeRO,
DeepSpeed's fp16 / bf16 / fp32 optimizer wrappers each accumulate in the model's own dtype only.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from .errors import NotSupportedError
from .section import Section

# The same order as the recipe's precisions (finetune/recipe_sections.py PRECISIONS): typing caches Literal types by
# their set of values, so whichever order is built first would name the values in every error of the other.
GradAccumDtype = Literal["fp32", "bf16", "fp16"]


class DataTypesConfig(Section):
    """``data_types``: dtypes DeepSpeed lets a config choose (only the accumulation one exists)."""

    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "grad_accum_dtype": "gradients always accumulate in fp32 buffers, whatever the model's dtype",
    }

    grad_accum_dtype: Optional[GradAccumDtype] = None
    """dtype of the gradient sums over micro-steps; None: the model's (DeepSpeed) -- fp32 here in any case."""


def model_dtype_name(cfg: Any) -> str:
    """"fp16", "bf16" or "fp32": the dtype mixed precision trains the model in."""
    if cfg.fp16.enabled is True:
        return "fp16"
    if cfg.bf16.enabled is True:
        return "bf16"
    return "fp32"


def check_grad_accum_dtype(cfg: Any) -> None:
    """Refuse, as DeepSpeed does, an accumulation dtype other than the model's when ZeRO is off."""
    accum = cfg.data_types.grad_accum_dtype
    stage = cfg.zero_optimization.stage
    if accum is None or not isinstance(stage, int) or stage > 0:
        return  # ZeRO stages 1-3 take any accumulation dtype for any model dtype
    model = model_dtype_name(cfg)
    if accum != model:
        raise NotSupportedError(
            "data_types.grad_accum_dtype",
            f"'{accum}' with model dtype {model} needs ZeRO (zero_optimization.stage 1, 2 or 3); without ZeRO the "
            f"accumulation dtype is the model's: omit the key or set '{model}' (DeepSpeed refuses this too)")
