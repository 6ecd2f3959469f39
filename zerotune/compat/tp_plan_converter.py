"""``deepspeed.module_inject.tp_plan_converter``: a Hugging Face ``tp_plan`` as DeepSpeed ``TPLayerSpec``s.

The translation is zerotune's own (``parallel/tensor/hf_plan.py``, which the engine applies when a model has
no user rules and no built-in plan); this class only hands its rules out in DeepSpeed's spec objects.
"""

from __future__ import annotations

import logging
from typing import Optional

from zerotune.compat.autotp_config import PartitionType, TPLayerSpec
from zerotune.parallel.tensor.hf_plan import rules_from_hf_plan, unsupported_styles, wildcard_to_regex

logger = logging.getLogger("zerotune")


class TPPlanConverter:
    """``convert(plan)``: the plan's entries as specs in order, or None when a style is one zerotune cannot run."""

    @staticmethod
    def convert(hf_tp_plan: dict[str, str]) -> Optional[list[TPLayerSpec]]:
        rules = rules_from_hf_plan(hf_tp_plan)
        if rules is None:
            logger.warning("Hugging Face tp_plan has partition style(s) zerotune's layers cannot run: %s; "
                           "the plan is not used", unsupported_styles(hf_tp_plan))
            return None
        return [TPLayerSpec(patterns=list(rule.patterns), partition_type=PartitionType(rule.partition_type),
                            gather_output=rule.gather_output) for rule in rules]

    _wildcard_to_regex = staticmethod(wildcard_to_regex)


__all__ = ["TPPlanConverter"]
