"""AutoTP: shard a Hugging Face model's layers over the tensor-parallel ranks in place.

``apply_autotp(model, group, ...)`` finds each layer a rule names (built-in plan of the
architecture, ``plans.py``, or the user's ``partition_config.layer_specs``), checks the sizes
divide, and swaps the module for its column/row/vocab-parallel counterpart (``layers.py``)
under the same name, so state-dict keys stay the model's own.

The parameter *objects* are kept: each keeps its identity and ``requires_grad`` and only its
``.data`` becomes this rank's shard (marked with its ``TPLayout``). Optimizers or parameter
lists a script built before ``initialize`` therefore still point at the trained tensors, and
weights tied across modules (GPT-2's ``wte`` and ``lm_head``) stay tied.

Every tp rank must start from the same full weights (``initialize`` broadcasts rank 0's first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerotune.parallel.tensor.cross_entropy import vocab_parallel_causal_lm_loss
from zerotune.parallel.tensor.hf_plan import hf_tp_plan, rules_from_hf_plan, unsupported_styles
from zerotune.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerotune.parallel.tensor.layout import mark_tensor_parallel, tp_layout_of
from zerotune.parallel.tensor.plans import PLANS, ArchitecturePlan, LayerRule


class TensorParallelPlanError(ValueError):
    """The model cannot be split as asked; the message names the module and the numbers."""


@dataclass(frozen=True)
class ShardedLayer:
    name: str
    kind: str  # "column" | "row" | "vocab"


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _is_causal_lm(model: nn.Module) -> bool:
    """Whether the model computes its LM loss through ``self.loss_function`` (so a vocab-parallel one can stand in)."""
    name = type(model).__name__
    return hasattr(type(model), "loss_function") and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def _plan_for(model: nn.Module, tp: int, user_rules: tuple[LayerRule, ...], use_default: bool
              ) -> tuple[tuple[LayerRule, ...], ArchitecturePlan | None, bool]:
    """The rules to apply, the built-in plan (if any) and whether the rules are the model's own HF plan.

    Precedence: the user's rules (followed by the built-in plan unless ``use_default_specs`` is off), else the
    built-in plan, else the model's own Hugging Face plan (``hf_plan.py``)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    plan = PLANS.get(model_type) if use_default and model_type is not None else None
    if plan is None and not user_rules:
        hf_plan = hf_tp_plan(model)
        hf_rules = rules_from_hf_plan(hf_plan) if hf_plan else None
        if hf_rules:
            return hf_rules, None, True
        unusable = (f"; its own Hugging Face plan has style(s) zerotune's layers cannot run: "
                    f"{unsupported_styles(hf_plan)}" if hf_plan else "")
        raise TensorParallelPlanError(
            f"tensor_parallel.autotp_size={tp}: no built-in tensor-parallel plan for {type(model).__name__} "
            f"(model_type {model_type!r}){unusable}; built-in plans: {', '.join(sorted(PLANS))}. Give your own "
            "rules in tensor_parallel.partition_config.layer_specs, e.g. "
            '[{"patterns": [".*\\\\.q_proj\\\\.weight"], "partition_type": "column"}, ...]')
    rules = user_rules + (plan.rules if plan else ())
    if not _is_causal_lm(model):  # no loss_function to swap: keep vocabulary layers whole
        rules = tuple(r for r in rules if not r.vocab)
    return rules, plan, False


def _check_heads(model: nn.Module, plan: ArchitecturePlan | None, tp: int) -> None:
    if plan is None:
        return
    config = model.config
    for attribute in plan.head_attributes:
        heads = getattr(config, attribute, None)
        if isinstance(heads, int) and heads % tp:
            raise TensorParallelPlanError(
                f"tensor parallelism: {type(model).__name__}'s attention modules have {attribute}={heads} heads, "
                f"not divisible by the tensor-parallel size {tp} (tensor_parallel.autotp_size); pick a size "
                f"that divides {heads}")


def _rule_for(weight_name: str, rules: tuple[LayerRule, ...]) -> LayerRule | None:
    return next((rule for rule in rules if rule.matches(weight_name)), None)


def _build(name: str, module: nn.Module, rule: LayerRule, full: dict[int, torch.Tensor],
           group: dist.ProcessGroup) -> tuple[nn.Module, str]:
    """The parallel replacement of ``module`` built from the full weights (``full`` by parameter id)."""
    weight = full[id(module.weight)]
    bias = getattr(module, "bias", None)
    bias = full[id(bias)] if isinstance(bias, nn.Parameter) else None
    if isinstance(module, nn.Embedding):
        if rule.partition_type != "column":
            raise TensorParallelPlanError(f"tensor parallelism: embedding '{name}' can only be split over its "
                                          f"vocabulary (partition_type 'column'), not '{rule.partition_type}'")
        return VocabParallelEmbedding.from_full(weight, group, padding_idx=module.padding_idx), "vocab"
    if isinstance(module, nn.Linear) or _is_conv1d(module):
        layout = "in_out" if _is_conv1d(module) else "out_in"
        if rule.partition_type == "column" and rule.gather_output and rule.parts == 1 and (
                weight.shape[0 if layout == "out_in" else 1] % dist.get_world_size(group)):
            # A gathered output that does not divide: split the input features instead (each rank sums its part
            # of every output), the same full output on every rank -- DeepSpeed's LmHeadLinearAllreduce.
            return RowParallelLinear.from_full(weight, bias, group, weight_layout=layout,
                                               input_is_parallel=False), "row"
        if rule.partition_type == "column":
            layer = ColumnParallelLinear.from_full(weight, bias, group, weight_layout=layout, parts=rule.parts,
                                                   gather_output=rule.gather_output)
            return layer, "vocab" if rule.vocab else "column"
        if rule.parts != 1:
            raise TensorParallelPlanError(f"tensor parallelism: '{name}': parts={rule.parts} applies to column "
                                          "splits only (fused outputs)")
        return RowParallelLinear.from_full(weight, bias, group, weight_layout=layout), "row"
    raise TensorParallelPlanError(
        f"tensor parallelism: rule {list(rule.patterns)} matches '{name}.weight' of a {type(module).__name__}; "
        "only nn.Linear, transformers' Conv1D and nn.Embedding layers can be split")


def _adopt_parameters(layer: nn.Module, module: nn.Module) -> None:
    """Give ``layer`` the original parameter objects, holding the shards ``layer`` built."""
    for attribute in ("weight", "bias"):
        original = getattr(module, attribute, None)
        built = getattr(layer, attribute, None)
        if not isinstance(original, nn.Parameter) or not isinstance(built, nn.Parameter):
            continue
        original.data = built.data
        layout = tp_layout_of(built)
        if layout is not None:
            mark_tensor_parallel(original, layout)
        setattr(layer, attribute, original)


def layers_to_split(model: nn.Module, tp: int, *, layer_specs: tuple[LayerRule, ...] = (),
                    use_default_specs: bool = True) -> tuple[list[tuple[str, nn.Module, LayerRule]],
                                                            ArchitecturePlan | None]:
    """The ``(name, module, rule)`` of every layer ``apply_autotp`` splits over ``tp`` ranks (model order), and
    the architecture plan; ``zerotune plan`` reads the split from here without a process group."""
    rules, plan, from_hf_plan = _plan_for(model, tp, tuple(layer_specs), use_default_specs)
    _check_heads(model, plan, tp)
    chosen: list[tuple[str, nn.Module, LayerRule]] = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), nn.Parameter):
            rule = _rule_for(f"{name}.weight", rules)
            if rule is not None and rule.partition_type != "skip":
                chosen.append((name, module, rule))
    if from_hf_plan:  # the model's plan names an LM head that is tied to the (unnamed) embedding: keep both whole
        chosen = untied_layers(model, chosen)
    # Rules that only say "skip" (DeepSpeed's way to set up tp groups and split nothing) may match nothing; a
    # split rule that matched nothing is most likely a misspelt pattern.
    skip_only = bool(layer_specs) and all(rule.partition_type == "skip" for rule in layer_specs)
    if not chosen and not skip_only:
        raise TensorParallelPlanError(
            f"tensor parallelism: no layer of {type(model).__name__} matched the tensor-parallel rules "
            f"{[list(r.patterns) for r in rules]}; check the patterns against model.named_parameters()")
    return chosen, plan


def apply_autotp(model: nn.Module, group: dist.ProcessGroup, *, layer_specs: tuple[LayerRule, ...] = (),
                 use_default_specs: bool = True, gather_logits: bool = False) -> list[ShardedLayer]:
    """Split ``model``'s layers over ``group`` in place; returns what was split, in model order.

    ``gather_logits`` (inference): a vocabulary-parallel LM head all-gathers its logits to the full
    vocabulary and the model keeps its own loss, so ``generate`` and sampling see every token's score;
    training keeps this rank's vocabulary shard and the vocab-parallel loss (no ``[B, T, V]`` gather).
    """
    tp = dist.get_world_size(group)
    chosen, plan = layers_to_split(model, tp, layer_specs=layer_specs, use_default_specs=use_default_specs)
    full = {id(p): p.detach().clone() for _, module, _ in chosen for p in module.parameters(recurse=False)}
    _check_ties(model, chosen)
    sharded = []
    for name, module, rule in chosen:
        try:
            layer, kind = _build(name, module, rule, full, group)
        except TensorParallelPlanError:
            raise
        except ValueError as error:
            raise TensorParallelPlanError(f"tensor parallelism: cannot split '{name}' "
                                          f"({type(module).__name__}): {error}") from None
        _adopt_parameters(layer, module)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        sharded.append(ShardedLayer(name, kind))
    if plan is not None and plan.localize is not None:
        for module in model.modules():
            plan.localize(module, tp)
    vocab = [model.get_submodule(layer.name) for layer in sharded if layer.kind == "vocab"]
    heads = [head for head in vocab if isinstance(head, ColumnParallelLinear)]
    for head in heads:
        head.gather_output = gather_logits
    if heads and not gather_logits:
        lm: Any = model  # (a transformers causal LM: nn.Module does not declare its loss_function)
        lm.loss_function = vocab_parallel_causal_lm_loss(group)
    return sharded


def untied_layers(model: nn.Module, chosen: list[tuple[str, nn.Module, LayerRule]]
                  ) -> list[tuple[str, nn.Module, LayerRule]]:
    """``chosen`` less the layers whose weight another module shares without being chosen itself (replicated)."""
    names = {name for name, _, _ in chosen}
    shared = {id(module.weight) for name, module in model.named_modules()
              if name not in names and isinstance(getattr(module, "weight", None), nn.Parameter)}
    return [(name, module, rule) for name, module, rule in chosen if id(module.weight) not in shared]


def _check_ties(model: nn.Module, chosen: list[tuple[str, nn.Module, LayerRule]]) -> None:
    """A weight shared by two layers must be split the same way in both (or in neither)."""
    split = {id(module.weight): (name, rule.partition_type) for name, module, rule in chosen}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and id(weight) in split:
            other, kind = split[id(weight)]
            mine = next((rule.partition_type for n, _, rule in chosen if n == name), None)
            if mine is None:
                raise TensorParallelPlanError(
                    f"tensor parallelism: '{name}.weight' is tied to '{other}.weight', which is split "
                    f"({kind}); split both the same way or neither (a rule for '{name}.weight' is missing)")
