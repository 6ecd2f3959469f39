"""DeepSpeed's injection policies as AutoTP rules, and AutoTP's plans as injection policies.

DeepSpeed's user-specified tensor parallelism names, per transformer block class, the linear layers whose
outputs must be all-reduced: ``{LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}``. Those are the
row-parallel layers; the block's other linears are column-parallel. That is exactly a list of zerotune
``LayerRule``s over the block's weight names, so ``init_inference(injection_policy=...)`` runs through the
same ``apply_autotp`` as training (a fused q|k|v keeps the built-in plan's parts). The other direction,
``injection_policy_of(model)``, is DeepSpeed's ``AutoTP.tp_parser``: the built-in plan in that format.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from zerotune.parallel.tensor.autotp import TensorParallelPlanError, layers_to_split
from zerotune.parallel.tensor.plans import PLANS, LayerRule


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's linears, weight stored [in, out])."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _class_matches(module: nn.Module, block: Any) -> bool:
    return type(module) is block if isinstance(block, type) else type(module).__name__ == block


def _ends_with(name: str, suffix: str) -> bool:
    """``self_attn.o_proj`` ends with ``o_proj`` / ``.o_proj`` / ``self_attn.o_proj``, not with ``proj``."""
    suffix = suffix.lstrip(".")
    return name == suffix or name.endswith("." + suffix)


def rules_from_injection_policy(model: nn.Module, policy: dict) -> tuple[LayerRule, ...]:
    """One rule per linear inside each block the policy names: row if its name ends with a listed name,
    else column (with the built-in plan's fused parts where it has a column rule for that weight)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    builtin = PLANS.get(model_type) if model_type is not None else None
    names_in_model = [name for name, _ in model.named_modules()]
    rules: list[LayerRule] = []
    for block, row_names in policy.items():
        row_names = (row_names,) if isinstance(row_names, str) else tuple(row_names)
        label = getattr(block, "__name__", block)
        blocks = [(name, module) for name, module in model.named_modules() if _class_matches(module, block)]
        if not blocks:
            raise TensorParallelPlanError(f"injection_policy: {type(model).__name__} has no module of class "
                                          f"{label}; name the transformer block class its layers are built of")
        for row in row_names:
            if not any(_ends_with(name, row) for name in names_in_model):
                raise TensorParallelPlanError(f"injection_policy: {label}: no layer named '{row}' in "
                                              f"{type(model).__name__} (e.g. 'self_attn.o_proj', 'mlp.down_proj')")
        for block_name, module in blocks:
            for sub_name, sub in module.named_modules():
                if not sub_name or not _is_linear(sub):
                    continue
                weight = f"{block_name}.{sub_name}.weight" if block_name else f"{sub_name}.weight"
                if any(_ends_with(sub_name, row) for row in row_names):
                    rules.append(LayerRule((re.escape(weight),), "row"))
                    continue
                known = next((r for r in (builtin.rules if builtin else ()) if r.matches(weight)), None)
                parts = known.parts if known is not None and known.partition_type == "column" else 1
                rules.append(LayerRule((re.escape(weight),), "column", parts))
    return tuple(rules)


def injection_policy_of(model: nn.Module) -> list[tuple[type, tuple[str, ...]]]:
    """The built-in plan of ``model`` as DeepSpeed's ``AutoTP.tp_parser`` gives it: per block class (a child
    of a ``ModuleList``), the names of its row-parallel linears relative to the block."""
    chosen, _ = layers_to_split(model, 1)
    blocks = {name: module for name, module in model.named_modules() if isinstance(module, nn.ModuleList)}
    policy: dict[type, dict[str, None]] = {}  # names in model order, once each
    for name, _, rule in chosen:
        if rule.partition_type != "row":
            continue
        for list_name, layers in blocks.items():
            prefix = f"{list_name}." if list_name else ""
            index, _, rest = name[len(prefix):].partition(".")
            if name.startswith(prefix) and index.isdigit() and rest:
                policy.setdefault(type(layers[int(index)]), {})[rest] = None
                break
    return [(block, tuple(names)) for block, names in policy.items()]
