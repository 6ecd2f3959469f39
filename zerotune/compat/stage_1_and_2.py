"""``deepspeed.runtime.zero.stage_1_and_2`` under the alias: the ZeRO optimizer wrapper (``pt.py``) and
DeepSpeed's ZeRO 2 model-state estimators (``zerotune/plan/estimators.py``)."""

from __future__ import annotations

from zerotune.compat.pt import DeepSpeedZeroOptimizer
from zerotune.plan.estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs",
           "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero2_model_states_mem_needs_all_live",
           "model_to_params"]
