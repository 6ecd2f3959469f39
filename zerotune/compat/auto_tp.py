"""``deepspeed.module_inject.auto_tp``: DeepSpeed's ``AutoTP`` driver over zerotune's tensor-parallel layers.

DeepSpeed code (and its tests) splits a model by hand with an ``AutoTPConfig``::

    autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None,
                    linear_layer_setting=None, orig_layer_impl=None, partition_config=config)
    autotp.set_tensor_parallel_config(tp_size, group)
    autotp.update_linear_policies()
    autotp._replace_module(model)

Here each step is zerotune's: the specs become zerotune's ``LayerRule``s (``autotp_config.layer_rules``, so a
spec matches the same parameters as in the engine's ``partition_config``), each matched layer is replaced by a
zerotune column- or row-parallel layer under DeepSpeed's class names (``tp_layers.build_tp_layer``; equal fused
sub-parameters, ``shape=(n, -1)``, by zerotune's ``parts``), and a layer whose weight another module shares
(an LM head tied to its embedding) stays whole, as in the engine when it follows a model's own plan.

Only the partition-config route exists: DeepSpeed's heuristic route (no ``partition_config``: guessing
all-reduce linears from module names) is zerotune's built-in plans, applied by ``initialize`` /
``init_inference``; loading weights from a ``state_dict`` while splitting is DeepSpeed's inference checkpoint
loader. Both are refused with a ValueError naming what to use. ``keep_module_on_host`` has no effect (zerotune
splits the tensors where they are). ``tp_parser`` / ``supported`` describe zerotune's built-in plans.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from zerotune.compat.autotp_config import AutoTPConfig, PartitionType, TPLayerSpec, spec_parts
from zerotune.compat.tp_layers import build_tp_layer
from zerotune.inference.injection import injection_policy_of
from zerotune.parallel.tensor.layers import ColumnParallelLinear
from zerotune.parallel.tensor.plans import PLANS


class AutoTP:
    """Split ``module``'s layers that ``partition_config``'s specs name over a tensor-parallel group, in place."""

    def __init__(self, module: nn.Module, all_reduce_linears: Any = (), prefix: str = "", state_dict: Any = None,
                 linear_layer_setting: Any = None, orig_layer_impl: Any = None, keep_module_on_host: bool = False,
                 partition_config: Optional[AutoTPConfig] = None) -> None:
        if partition_config is None:
            raise ValueError("AutoTP(partition_config=None): DeepSpeed's module-name heuristics are zerotune's "
                             "built-in plans, applied by deepspeed.initialize (tensor_parallel.autotp_size) and "
                             "init_inference; give an AutoTPConfig to split by hand")
        if state_dict is not None:
            raise ValueError("AutoTP(state_dict=...): loading checkpoint weights while splitting is DeepSpeed's "
                             "inference loader; load the weights into the model first, then split it")
        self.module, self.prefix, self.partition_config = module, prefix, partition_config
        self.all_reduce_linears, self.keep_module_on_host = all_reduce_linears, keep_module_on_host
        self.mp_size: int = 1
        self.mp_group: Optional[dist.ProcessGroup] = None
        self._tied: set[str] = set()

    def set_tensor_parallel_config(self, mp_size: int, mp_group: Optional[dist.ProcessGroup]) -> None:
        """The tp size and group the layers split over (a None group: this process holds every shard, size 1)."""
        self.mp_size, self.mp_group = int(mp_size), mp_group

    def update_linear_policies(self) -> None:
        """Check the specs against what zerotune's layers can run before any layer changes (fails naming a spec)."""
        for spec in self.partition_config.layer_specs:
            if spec.partition_type != PartitionType.SKIP:
                spec_parts(spec)

    def _get_model_type(self) -> Optional[str]:
        return getattr(getattr(self.module, "config", None), "model_type", None)

    def _replace_module(self, r_module: nn.Module, prev_name: str = "", prev_class_name: str = "") -> nn.Module:
        """Replace, in place, each layer under ``r_module`` a spec splits; specs see full dotted names."""
        self._tied = _shared_weight_modules(r_module)
        self._walk(r_module, prev_name)
        return r_module

    def _walk(self, r_module: nn.Module, prev_name: str) -> None:
        for name, child in list(r_module.named_children()):
            full_name = f"{prev_name}.{name}" if prev_name else name
            weight = getattr(child, "weight", None)
            if isinstance(child, nn.Embedding):
                spec = self.partition_config.find_matching_spec(f"{full_name}.weight", self._get_model_type())
                if spec is not None and spec.partition_type != PartitionType.SKIP and full_name not in self._tied:
                    raise ValueError(f"AutoTP spec {spec.patterns} matches the embedding '{full_name}': zerotune "
                                     "splits embeddings over the vocabulary only in its built-in plans (with the "
                                     "vocab-parallel loss); leave it replicated (partition_type 'skip')")
            elif isinstance(weight, nn.Parameter) and weight.dim() == 2:
                replaced = self._replace_with_config(child, full_name)
                if replaced is not None and replaced is not child:
                    setattr(r_module, name, replaced)
            else:
                self._walk(child, full_name)

    def _replace_with_config(self, child: nn.Module, name: str) -> Optional[nn.Module]:
        """The split replacement of layer ``name`` by its first matching spec, or ``child`` itself (unchanged)."""
        param_name = name if name.endswith(".weight") else f"{name}.weight"
        spec = self.partition_config.find_matching_spec(param_name, self._get_model_type())
        if spec is None:
            if self.partition_config.strict_mode:
                raise ValueError(f"AutoTP strict_mode: no layer_specs entry matches {param_name}")
            return child
        if spec.partition_type == PartitionType.SKIP or name in self._tied:
            return child  # skipped, or a weight another module shares: both stay whole
        if not isinstance(child, nn.Linear):
            raise ValueError(f"AutoTP spec {spec.patterns} matches '{name}' ({type(child).__name__}): zerotune "
                             "replaces nn.Linear layers only (it cannot know another module's forward is a linear)")
        return self._split(child, spec, name)

    def _split(self, child: nn.Linear, spec: TPLayerSpec, name: str) -> nn.Module:
        parts = spec_parts(spec)
        if spec.partition_type == PartitionType.ROW:
            return build_tp_layer(child, "row", self.mp_group, name=name)
        if spec.gather_output and child.out_features % max(self.mp_size, 1):
            if name.split(".")[-1] in self.partition_config.lm_head_patterns:
                return build_tp_layer(child, "lm_head", self.mp_group, name=name)  # uneven vocabulary: split rows
            raise ValueError(f"AutoTP: '{name}' has {child.out_features} output features, not divisible by the "
                             f"tensor-parallel size {self.mp_size} (gather_output)")
        if parts > 1:
            layer = ColumnParallelLinear.from_full(child.weight.detach(), _detached(child.bias), self.mp_group,
                                                   parts=parts, gather_output=spec.gather_output)
            return layer
        return build_tp_layer(child, "column", self.mp_group, gather_output=spec.gather_output, name=name)

    @staticmethod
    def tp_parser(model: nn.Module) -> list[tuple[type, tuple[str, ...]]]:
        """Per transformer block class, the names of its row-parallel linears (DeepSpeed's policy list)."""
        return injection_policy_of(model)

    @staticmethod
    def supported(model: nn.Module) -> bool:
        """Whether zerotune has a built-in plan for the model's architecture."""
        return getattr(getattr(model, "config", None), "model_type", None) in PLANS


def _detached(bias: Optional[nn.Parameter]) -> Any:
    return None if bias is None else bias.detach()


def _shared_weight_modules(model: nn.Module) -> set[str]:
    """Names of the modules whose weight another module holds too (a tied LM head and its embedding)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            owners.setdefault(id(weight), []).append(name)
    return {name for names in owners.values() if len(set(names)) > 1 for name in names}


__all__ = ["AutoTP", "AutoTPConfig", "PartitionType", "TPLayerSpec"]
