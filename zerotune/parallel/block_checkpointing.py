"""Checkpointing a model's blocks: ``apply_activation_checkpointing(model)`` replaces each transformer block's
``forward`` by a call through ``activation_checkpointing.run_checkpointed`` (why ``forward`` and not
``__call__``, and whose policy applies, are in ``activation_checkpointing.py``); reversible, and what
``initialize`` does when a config's ``activation_checkpointing`` block asks it to wrap the model's blocks."""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zerotune.distributed.guard_scope import GuardScope
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.activation_checkpointing import (
    CheckpointPolicy,
    configured_policy,
    policy_in_force,
    process_rank,
    run_checkpointed,
)
from zerotune.parallel.checkpoint_caches import without_empty_caches

_STATE = "_zerotune_activation_checkpoint"
_ABSENT = object()


@dataclass
class _Wrapped:
    """What a checkpointed block remembers: its name, its policy (None: its engine's, or the one in force, at call
    time) and the engine whose ``initialize`` wrapped it."""

    name: str
    policy: CheckpointPolicy | None
    engine: GuardScope | None
    layer_idx: int | None
    previous_forward: Any  # the instance attribute ``forward`` had before wrapping, or _ABSENT
    warned: bool = False


def apply_activation_checkpointing(model: torch.nn.Module, policy: CheckpointPolicy | None = None, *,
                                   modules: Iterable[type | str] | None = None) -> list[str]:
    """Checkpoint the forward of the model's blocks; returns the names of the wrapped modules.

    Blocks: modules whose class name is in a ``_no_split_modules`` found on the model or a submodule,
    or those matching ``modules`` (classes, class names or module names); a match nested in another
    is left alone. With ``policy.number_checkpoints = n`` only n evenly spaced blocks are wrapped.
    Applying again first removes the previous wrapping (never double-wraps). ``policy=None``: each
    call follows whatever ``configure`` set at that time (so the order relative to
    ``zerotune.initialize`` does not matter); ``number_checkpoints`` is read now.
    """
    return _wrap_blocks(model, policy, modules, engine=None)


def _layer_index(block: torch.nn.Module) -> int | None:
    """The first int ``layer_idx`` among the block's modules (Hugging Face attention layers carry one)."""
    for module in block.modules():
        index = getattr(module, "layer_idx", None)
        if type(index) is int:
            return index
    return None


def _wrap_blocks(model: torch.nn.Module, policy: CheckpointPolicy | None, modules: Iterable[type | str] | None,
                 engine: GuardScope | None) -> list[str]:
    """``apply_activation_checkpointing``; ``engine``: the engine whose policy the blocks follow (None: the one
    in force at each call)."""
    _refuse_hf_checkpointing(model)
    remove_activation_checkpointing(model)
    in_force = policy or (policy_in_force(engine) if engine is not None else configured_policy())
    chosen = _evenly_spaced(checkpoint_block_names(model, modules), in_force.number_checkpoints)
    for name in chosen:
        module = model.get_submodule(name)
        state = _Wrapped(name, policy, engine, _layer_index(module), module.__dict__.get("forward", _ABSENT))
        setattr(module, _STATE, state)
        module.forward = types.MethodType(_checkpointed_forward, module)
    return chosen


def checkpoint_blocks_at_initialize(model: torch.nn.Module, wrap_blocks: bool | None,
                                    engine: GuardScope | None = None) -> tuple[list[str], str]:
    """What ``initialize`` does with an ``activation_checkpointing`` block: the wrapped names, and why. The blocks
    follow ``engine``'s policy (its guards, ``engine_guards.py``) wherever they are called from.

    In DeepSpeed the block only configures ``deepspeed.checkpointing`` for the model's own
    ``checkpoint(...)`` calls; tools such as Lightning write it for every model. So a model that
    declares no blocks, or already checkpoints them itself (Hugging Face gradient checkpointing), is
    left alone unless ``wrap_blocks`` is true; false never wraps.
    """
    if wrap_blocks is False:
        return [], "wrap_blocks is false: the block configures zerotune.checkpointing only"
    if wrap_blocks is None:
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            return [], "the model's own (Hugging Face) gradient checkpointing is on; its blocks are left to it"
        if not any(getattr(m, "_no_split_modules", None) for m in model.modules()):
            return [], ("the model declares no transformer blocks (no _no_split_modules): the block configures "
                        "zerotune.checkpointing for the model's own checkpoint(...) calls")
    wrapped = _wrap_blocks(model, None, None, engine)
    return wrapped, f"{len(wrapped)} block(s) wrapped" + (f" ({wrapped[0]}, ...)" if wrapped else "")


def remove_activation_checkpointing(model: torch.nn.Module) -> list[str]:
    """Undo ``apply_activation_checkpointing``; returns the names of the modules restored."""
    restored = []
    for name, module in model.named_modules():
        state = module.__dict__.get(_STATE)
        if state is None:
            continue
        if getattr(module.__dict__.get("forward"), "__func__", None) is not _checkpointed_forward:
            raise RuntimeError(f"remove_activation_checkpointing: '{name}'.forward was replaced after checkpointing "
                               "was applied; remove that wrapper first")
        if state.previous_forward is _ABSENT:
            del module.forward
        else:
            module.forward = state.previous_forward
        delattr(module, _STATE)
        restored.append(name)
    return restored


def checkpointed_module_names(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose forward is currently checkpointed."""
    return [name for name, module in model.named_modules() if _STATE in module.__dict__]


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _Wrapped = self.__dict__[_STATE]
    inner = (state.previous_forward if state.previous_forward is not _ABSENT
             else types.MethodType(type(self).forward, self))
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    args, kwargs, replayable = without_empty_caches(args, kwargs, state.layer_idx)
    if not replayable:
        if not state.warned:
            state.warned = True
            log_rank0("activation checkpointing: %s got a cache holding past key/values (e.g. a prefix); the recompute "
                      "would update it twice, so this call runs without checkpointing", state.name, rank=process_rank())
        return inner(*args, **kwargs)
    policy = state.policy or (policy_in_force(state.engine) if state.engine is not None else configured_policy())
    return run_checkpointed(inner, args, kwargs, policy, state.name)


def _refuse_hf_checkpointing(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            raise ValueError(f"apply_activation_checkpointing: Hugging Face gradient checkpointing is already enabled "
                             f"on '{name or type(model).__name__}'; call model.activation_checkpointing_disable() "
                             "(gradient_checkpointing_disable() before transformers 5) first: checkpointing twice "
                             "recomputes every block twice")


def checkpoint_block_names(model: torch.nn.Module, modules: Iterable[type | str] | None) -> list[str]:
    named = list(model.named_modules())
    if modules is None:
        classes = sorted({c for _, m in named for c in (getattr(m, "_no_split_modules", None) or [])})
        if not classes:
            raise ValueError(f"apply_activation_checkpointing: {type(model).__name__} has no _no_split_modules (not a "
                             "Hugging Face transformer?); pass modules=[...] with the block classes or module names")
        wanted: list[type | str] = list(classes)
    else:
        wanted = list(modules)
        for entry in wanted:
            if not isinstance(entry, (type, str)):
                raise TypeError("apply_activation_checkpointing: modules entries must be classes or names, "
                                f"got {entry!r}")

    def matches(name: str, module: torch.nn.Module, entry: type | str) -> bool:
        if isinstance(entry, type):
            return isinstance(module, entry)
        return type(module).__name__ == entry or (modules is not None and name == entry)

    if modules is not None:
        unknown = [e for e in wanted if not any(matches(n, m, e) for n, m in named)]
        if unknown:
            classes = sorted({type(m).__name__ for _, m in named})
            raise ValueError(f"apply_activation_checkpointing: modules={unknown!r} match no module of "
                             f"{type(model).__name__}; its module classes are {classes[:12]}")
    chosen: list[str] = []
    for name, module in named:
        if any(name == c or name.startswith(f"{c}.") or c == "" for c in chosen):
            continue  # nested inside a block already chosen
        if any(matches(name, module, entry) for entry in wanted):
            chosen.append(name)
    if not chosen:
        raise ValueError(f"apply_activation_checkpointing: no module of {type(model).__name__} is one of {wanted!r}")
    return chosen


def _evenly_spaced(names: list[str], count: int | None) -> list[str]:
    """``count`` names spread evenly from the first (12 blocks, 4 -> every 3rd); all when count is None or larger."""
    if count is None or count >= len(names):
        return names
    return [names[i * len(names) // count] for i in range(count)]
