"""``deepspeed.moe`` / ``deepspeed.moe.layer`` / ``deepspeed.moe.utils``: the MoE names DeepSpeed code imports.

zerotune has no mixture-of-experts layer yet. DeepSpeed code imports ``MoE`` at module level and passes every
model's parameters through ``split_params_into_different_moe_groups_for_optimizer`` (DeepSpeed's own test
models and checkpoint helpers do), so these names exist: ``MoE`` is refused when built, and the parameter-group
helpers are DeepSpeed's for a model with no expert parameters (the groups come back as they were). A
parameter marked as an expert's (``allreduce = False``, as DeepSpeed's experts mark theirs) needs expert
parallelism, which is refused naming it rather than trained as if it were dense.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.compat.refusals import refused_class

MoE = refused_class("deepspeed.moe.layer.MoE")

__all__ = ["MoE", "is_moe_param", "has_moe_layers", "is_moe_param_group",
           "split_params_into_different_moe_groups_for_optimizer", "configure_moe_param_groups",
           "split_params_into_shared_and_expert_params"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert's parameter: ``allreduce`` set to False (reduced over its expert group only)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: torch.nn.Module) -> tuple[bool, int]:
    """``(False, 0)``: zerotune builds no MoE layers (``MoE`` is refused)."""
    return False, 0


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params: list[torch.nn.Parameter]
                                               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: float = 178956971
                                                         ) -> list[dict]:
    """The optimizer's parameter groups with DeepSpeed's MoE split; without expert parameters, the groups as given
    (a dict or tuple of dicts as a list), which is all there is to split in zerotune."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: expected a dict or a list / tuple of "
                         f"parameter-group dicts, got {type(param_groups).__name__}")
    for group in param_groups:
        params = group["params"] = list(group["params"])
        experts = [p for p in params if is_moe_param(p)]
        if experts:
            raise DeepSpeedFeatureNotSupported(
                "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer",
                f"expert parallelism for MoE parameters ({len(experts)} marked allreduce=False in a group of "
                f"{len(params)})")
    return param_groups


def configure_moe_param_groups(model_parameters: list) -> list:
    """DeepSpeed's: a list of parameters becomes one group (named ``dense-params``); groups pass through the split."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError("configure_moe_param_groups: model_parameters must be a non-empty list of parameters or "
                        "parameter-group dicts")
    if isinstance(model_parameters[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                      "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
