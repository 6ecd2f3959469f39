"""``deepspeed.runtime.zero.stage3`` under the alias: the ZeRO optimizer wrapper (``pt.py``) and DeepSpeed's
ZeRO 3 model-state estimators (``zerotune/plan/estimators.py``). DeepSpeed's stage-3 ``model_to_params``
returns the parameter count and the largest layer's, unlike stage 1/2's."""

from __future__ import annotations

from zerotune.compat.pt import DeepSpeedZeroOptimizer_Stage3
from zerotune.plan.estimators import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zerotune.plan.estimators import model_to_params_and_largest_layer as model_to_params

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs_all_live",
           "model_to_params"]
