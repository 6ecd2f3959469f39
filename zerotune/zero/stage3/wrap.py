"""Which modules become communication units, and partitioning a model into them.

Units: for Hugging Face models, every module whose class is listed in a ``_no_split_modules``
attribute (the transformer block: ``GPT2Block``, ``LlamaDecoderLayer``...); for other models,
every module that directly owns parameters. The root unit takes the rest (embeddings, final
norm, tied head). A parameter used under two different units (shared weights) is moved to the
root unit, which stays gathered through forward and backward, so no unit ever computes with
another unit's released weights.
"""

from __future__ import annotations

from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist

from zerotune.zero.stage3.segment import FlatSegment
from zerotune.zero.stage3.sharded_param import sharded_param_of
from zerotune.zero.stage3.unit import BufferPool, ParamUnit

ROOT = ""
EXTERNAL_PARAMS = "_zerotune_external_params"  # set by zero.register_external_parameter


def unit_module_names(model: torch.nn.Module) -> list[str]:
    """Names of the modules that become units (the root, ``""``, excluded), in model order.

    A module marked as a ZeRO-3 leaf (``set_z3_leaf_modules``, DeepSpeed's API: an MoE block
    whose experts run data-dependently, say) is gathered whole as one unit: its descendants
    are never units of their own. A leaf root (the whole model marked) leaves no unit but the root.
    """
    if getattr(model, "_z3_leaf", False):
        return []
    block_classes = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}

    def is_unit(module: torch.nn.Module) -> bool:
        if block_classes:
            return type(module).__name__ in block_classes
        return next(module.parameters(recurse=False), None) is not None

    names: list[str] = []
    whole: list[str] = []  # leaves: their descendants are gathered with them
    for name, module in model.named_modules():
        if name == ROOT or any(name.startswith(outer + ".") for outer in whole):
            continue
        if getattr(module, "_z3_leaf", False) or is_unit(module):
            names.append(name)
            if getattr(module, "_z3_leaf", False):
                whole.append(name)
    return names


def _nearest_unit(module_name: str, units: set[str]) -> str:
    """The innermost unit containing module ``module_name`` (itself included), else the root."""
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in units:
            return candidate
    return ROOT


def assign_params(model: torch.nn.Module, unit_names: Sequence[str]) -> dict[str, list[torch.nn.Parameter]]:
    """Each parameter's unit (model order inside a unit); parameters shared across units go to the root."""
    units = set(unit_names)
    owner: dict[int, str] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        unit = _nearest_unit(module_name, units)
        # register_external_parameter: a parameter this module uses but another one owns counts as shared.
        for param in [*module.parameters(recurse=False), *getattr(module, EXTERNAL_PARAMS, ())]:
            if id(param) in owner and owner[id(param)] != unit:
                owner[id(param)] = ROOT
            else:
                owner.setdefault(id(param), unit)
            params[id(param)] = param
    assigned: dict[str, list[torch.nn.Parameter]] = {name: [] for name in [ROOT, *unit_names]}
    for key, param in params.items():
        assigned[owner[key]].append(param)
    return assigned


def _holds(segment: FlatSegment, param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is still partitioned by ``segment`` (not yet re-laid out by a new unit)."""
    sharded = sharded_param_of(param)
    assert sharded is not None  # (a segment's parameters stay partitioned: by it, or by the unit that took them)
    return sharded.segment is segment


def partition_model(model: torch.nn.Module, group: dist.ProcessGroup | None,
                    trainable_groups: Sequence[Sequence[torch.nn.Parameter]], *,
                    persistence_threshold: int, buffers: BufferPool | None = None,
                    shard_device: torch.device | None = None, pin_memory: bool = False,
                    on_unit_built: Callable[[ParamUnit], None] | None = None) -> list[ParamUnit]:
    """Partition every parameter of ``model`` into units; returns them root first.

    ``trainable_groups``: the optimizer's param groups (trainable parameters only). Inside a unit
    the trainable parameters are ordered by group, so a group's part of each shard is contiguous.
    Parameters already partitioned by ``zero.Init`` are gathered one unit at a time and re-laid out.
    ``shard_device``: where the shards live between uses (``offload_param``), default with the model.
    ``on_unit_built(unit)`` runs as each unit is built, before the next (masters, cast, swap-out), so
    set-up memory holds about one unit whatever the model size.
    """
    group_of = {id(p): g for g, params in enumerate(trainable_groups) for p in params}
    modules = dict(model.named_modules())
    names = unit_module_names(model)
    units = []
    for name, owned in assign_params(model, names).items():
        if not owned and name != ROOT:
            continue
        # (a sharded parameter's segment is the FlatSegment that made it)
        previous = {id(s.segment): cast(FlatSegment, s.segment) for s in map(sharded_param_of, owned) if s is not None}
        for segment in previous.values():  # zero.Init partitions: bring back the full values of this unit only
            segment.finish_gather()
        trainable = sorted((p for p in owned if id(p) in group_of), key=lambda p: group_of[id(p)])
        frozen = [p for p in owned if id(p) not in group_of]
        numel = sum(p.numel() for p in owned)
        units.append(ParamUnit(name, modules[name], trainable, frozen, group, is_root=name == ROOT,
                               persistent=numel < persistence_threshold, buffers=buffers,
                               shard_device=shard_device, pin_memory=pin_memory))
        for segment in previous.values():
            if not any(_holds(segment, p) for p in segment.params):
                segment.discard()
        if on_unit_built is not None:
            on_unit_built(units[-1])
    return units
