"""``engine.optimizer.parameter_offload`` at ZeRO stage 3: DeepSpeed's handle on the module hooks, over zerotune's.

TRL's ``unwrap_model_for_generation`` (trl/models/utils.py, ``remove_hooks`` / ``add_hooks``) gathers every
parameter with ``GatheredParameters``, removes ZeRO-3's forward hooks so ``generate()`` runs its many forwards
on the whole weights with no per-module gather and release, and registers them again before the block
ends. It reaches them through DeepSpeed's ``DeepSpeedZeRoOffload``: ``.module``, the hook handles in
``.forward_hooks`` / ``.backward_hooks`` (removed one by one, then the lists cleared), each parameter's
``ds_active_sub_modules`` and each module's ``ds_external_parameters()`` (cleared), and
``_register_deepspeed_module(module)`` to register them again.

Here the hooks are stage 3's forward hooks, reached through the stage (``zero/contracts.py``). A zerotune forward
hook also attaches that forward's backward hooks, so there are no module-level backward hooks: ``backward_hooks`` is
always empty.
Registering again first removes whatever zerotune registered before (the scheduler keeps its own record of
the handles), so hooks are never doubled, and the schedule's cursors restart at the root's next forward:
training continues as if the generation forwards had not run. ``param_coordinator`` (DeepSpeed's trace of
the module order) is absent on purpose: TRL only invalidates it, and zerotune records no trace.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from zerotune.compat.refusals import refused_class, refused_function
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.stage3.wrap import EXTERNAL_PARAMS

__all__ = ["DeepSpeedZeRoOffload", "ZeROOrderedDict", "ensure_zero_ordered_dict"]

# DeepSpeed swaps each module's ``_parameters`` for a dict that gathers a partitioned parameter read during another
# module's forward; zerotune leaves the containers alone (register_external_parameter declares such a use).
ZeROOrderedDict = refused_class("deepspeed.runtime.zero.parameter_offload.ZeROOrderedDict")
ensure_zero_ordered_dict = refused_function("deepspeed.runtime.zero.parameter_offload.ensure_zero_ordered_dict")


class _ExternalParameters:
    """``module.ds_external_parameters()``: ``(key, parameter)`` for each parameter registered on the module with
    ``register_external_parameter`` (DeepSpeed's method returns its ``{id: parameter}`` dict's items)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self) -> Iterator[tuple[int, torch.nn.Parameter]]:
        return iter([(id(p), p) for p in getattr(self.module, EXTERNAL_PARAMS, ())])


class DeepSpeedZeRoOffload:
    """The stage-3 engine's module hooks under DeepSpeed's names (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, stage: ZeroStage) -> None:
        self.module = module
        self._stage = stage
        for submodule in module.modules():
            if not hasattr(submodule, "ds_external_parameters"):
                # DeepSpeed's method hung on each module: a callable object, not a tensor or submodule
                submodule.ds_external_parameters = _ExternalParameters(submodule)  # type: ignore[assignment]

    @property
    def forward_hooks(self) -> list[Any]:
        """The units' forward hook handles (a copy: removing one removes the hook)."""
        return self._stage.forward_hook_handles()

    @forward_hooks.setter
    def forward_hooks(self, hooks: list[Any]) -> None:
        """``= []`` after removing the handles (TRL, DeepSpeed's ``unwrap_model_for_generation``): the stage forgets
        them too, so the list reads empty until ``_register_deepspeed_module`` registers them again."""
        _only_clear("forward_hooks", hooks)
        self._stage.detach_forward_hooks()

    @property
    def backward_hooks(self) -> list[Any]:
        """Always empty: zerotune's backward hooks are attached by the forward hooks, per forward."""
        return []

    @backward_hooks.setter
    def backward_hooks(self, hooks: list[Any]) -> None:
        _only_clear("backward_hooks", hooks)

    def _remove_module_hooks(self) -> None:
        """Remove stage 3's forward hooks (DeepSpeed's name)."""
        self._stage.detach_forward_hooks()

    def destroy(self) -> None:
        self._remove_module_hooks()

    def _register_deepspeed_module(self, module: torch.nn.Module, count: Any = None) -> None:
        """Register stage 3's forward hooks again, for every unit (DeepSpeed's name; ``count`` is its recursion
        counter). ``module`` must be the engine's module: zerotune's hooks are the whole model's schedule."""
        del count
        if module is not self.module:
            raise ValueError(f"_register_deepspeed_module: zerotune registers ZeRO stage 3's hooks for the whole "
                             f"model at once; pass the engine's module (parameter_offload.module, a "
                             f"{type(self.module).__name__}), not a {type(module).__name__}")
        self._stage.attach_forward_hooks()

    _register_hooks_recursively = _register_deepspeed_module  # DeepSpeed's name before 0.14


def _only_clear(name: str, hooks: list[Any]) -> None:
    """TRL clears the list after removing each handle; zerotune keeps the handles itself, so only clearing is
    meaningful (hooks are removed with ``handle.remove()`` or ``_remove_module_hooks()``)."""
    if list(hooks):
        raise ValueError(f"parameter_offload.{name} can only be cleared (= []): zerotune keeps ZeRO stage 3's hook "
                         "handles itself; register hooks again with _register_deepspeed_module(module)")
