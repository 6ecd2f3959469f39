"""ZeRO-3 leaf modules: modules stage 3 gathers whole, as one unit with everything under them.

A module whose submodules run data-dependently (MoE experts picked by a router, a layer chosen by a counter or by
the rank) would otherwise make ranks ask for different gathers and hang. The mark is DeepSpeed's: a plain
``_z3_leaf`` bool on the module, set by class, by exact ``named_modules()`` name or by name suffix (DeepSpeed's
``deepspeed.utils`` functions, which ``zerotune.compat.utils`` re-exports), or from the config's
``zero_optimization.leaf_module`` block when stage 3 is built (``apply_leaf_config``).
``stage3/wrap.py`` reads the mark when it lays out the units.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from zerotune.config.leaf_module_section import LeafModuleConfig

log = logging.getLogger(__name__)

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "get_z3_leaf_modules", "z3_leaf_module", "apply_leaf_config"]


def _class_matches(module: torch.nn.Module, classes: Iterable[type | str]) -> bool:
    """A class is matched by ``isinstance``; a string by the class's own name or its ``module.qualname``."""
    cls = type(module)
    return any(cls.__name__ == c or f"{cls.__module__}.{cls.__qualname__}" == c if isinstance(c, str)
               else isinstance(module, c) for c in classes)


def _flag_classes(model: torch.nn.Module, leaf_module_classes: list[type | str], flag: bool, caller: str,
                  raise_if_not_found: bool) -> list[torch.nn.Module]:
    if not all(isinstance(c, (type, str)) for c in leaf_module_classes):
        raise TypeError(f"{caller}: leaf_module_classes must be classes or class names, got {leaf_module_classes!r}")
    leaves = [m for m in model.modules() if _class_matches(m, leaf_module_classes)]
    if not leaves and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in leaf_module_classes]
        raise ValueError(f"{caller}: no module of class {', '.join(names)} in {type(model).__name__}")
    for module in leaves:
        module._z3_leaf = flag  # type: ignore[assignment]  # DeepSpeed's flag: a plain bool on the module
    return leaves


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every module of the given classes (classes, class names or ``module.qualname`` names) as a ZeRO-3
    leaf: stage 3 gathers it whole as one unit (for blocks whose submodules run data-dependently, such as MoE
    experts). Returns the modules marked; none found is a ValueError unless ``raise_if_not_found`` is false."""
    return _flag_classes(model, leaf_module_classes, True, "set_z3_leaf_modules", raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Clear the leaf mark of every module of the given classes (as ``set_z3_leaf_modules`` matches them)."""
    return _flag_classes(model, leaf_module_classes, False, "unset_z3_leaf_modules", raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf mark of the modules named exactly as in ``model.named_modules()``.

    Returns ``(modules marked, names not found)``; names not found are a ValueError when ``raise_if_not_found``
    (the modules found are marked first, as DeepSpeed's does)."""
    by_name = dict(model.named_modules())
    matched = [by_name[name] for name in module_names if name in by_name]
    missing = [name for name in module_names if name not in by_name]
    for module in matched:
        module._z3_leaf = flag
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in {type(model).__name__}")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Set the leaf mark of every module whose ``named_modules()`` name ends with one of the suffixes (plain
    string suffixes: ``"experts"`` also matches ``"layers.0.mlp.experts"``).

    Returns ``(modules marked, each once; suffixes that matched nothing)``; unmatched suffixes are a ValueError
    when ``raise_if_not_found``."""
    matched: dict[int, torch.nn.Module] = {}
    missing: list[str] = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in model.named_modules() if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            module._z3_leaf = flag
            matched.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name ends with {missing} in {type(model).__name__}")
    return list(matched.values()), missing


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_z3_leaf", False))


def apply_leaf_config(model: torch.nn.Module, section: LeafModuleConfig) -> list[torch.nn.Module]:
    """Mark the leaves ``zero_optimization.leaf_module`` names (classes, then names, then suffixes; each module
    once). Entries that match nothing are not errors -- the defaults name MoE blocks most models lack -- but a
    customized block's unknown names or suffixes, or one matching nothing at all, is logged."""
    marked: dict[int, torch.nn.Module] = {}
    for module in set_z3_leaf_modules(model, list(section.classes), raise_if_not_found=False):
        marked.setdefault(id(module), module)
    for mark, entries, what in ((set_z3_leaf_modules_by_name, section.names, "module names"),
                                (set_z3_leaf_modules_by_suffix, section.name_suffixes, "module-name suffixes")):
        if not entries:
            continue
        found, missing = mark(model, list(entries), raise_if_not_found=False)
        for module in found:
            marked.setdefault(id(module), module)
        if missing and section.customized():
            log.warning("zero_optimization.leaf_module: %s %s match no module", what, missing)
    if not marked and section.customized():
        log.warning("zero_optimization.leaf_module matched no module; stage 3 lays out its units as usual")
    return list(marked.values())
