"""``deepspeed.runtime.tensor_parallel.config``: where DeepSpeed reads a Hugging Face model's own tp plan.

``_get_hf_tp_plan(model)`` is zerotune's ``hf_tp_plan`` (``parallel/tensor/hf_plan.py``): the merged
``config.base_model_tp_plan`` / class / instance ``_tp_plan``, the plan zerotune's AutoTP falls back to.
DeepSpeed's ``TPTrainingConfig`` section is zerotune's ``tensor_parallel`` config section
(``config/sections.py``), not re-exported here.
"""

from __future__ import annotations

from zerotune.parallel.tensor.hf_plan import hf_tp_plan as _get_hf_tp_plan

__all__ = ["_get_hf_tp_plan"]
