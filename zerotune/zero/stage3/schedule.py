"""When each unit is gathered, released and reduced: the module hooks and the execution order.

Forward, per unit: gather before the module runs (and prefetch the next units in the order
recorded on the previous forward, up to ``prefetch_numel`` elements and while the live total
stays under ``max_live_numel``), release after it (except persistent units, and the root unit,
which is used again first thing in backward). A hook on the unit's outputs re-gathers it (and
prefetches in the recorded backward order) when backward reaches it.

A unit's backward is over when (a) every trainable parameter's gradient was accumulated and (b)
the gradients of the unit's inputs that require grad were computed (an identity autograd
function on the inputs reports it). Then its gradient is reduce-scattered and it is released.
Requiring (b) as well keeps frozen weights gathered while backward still needs them to
propagate gradients (LoRA: the base weight is needed after the adapter's gradients are done).

An end-of-backward callback handles what never completed: parameters that got no gradient,
units called but unused, prefetched units. Every unit with trainable parameters is reduced
exactly once per micro-step, in a fixed order for the stragglers, so all ranks issue the same
collectives. A module may run more than once per forward: it is gathered again when needed.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import torch
from torch.autograd.graph import register_multi_grad_hook

from zerotune.zero.grad_hooks import register_grad_ready_hooks
from zerotune.zero.stage3.unit import ParamUnit


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in nested tuples / lists / dicts (HF ModelOutput is a dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    return []


class _InputsGradReady(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients exist (the unit's backward is over)."""

    @staticmethod
    def forward(ctx, scheduler: "UnitScheduler", unit: ParamUnit, *inputs: torch.Tensor):
        ctx.scheduler, ctx.unit = scheduler, unit
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.scheduler._on_inputs_grad(ctx.unit)
        return (None, None, *grads)


def _in_backward() -> bool:
    """True inside autograd's backward (e.g. activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


class UnitScheduler:
    """Owns the hooks; also the engine's gradient-sync strategy for stage 3."""

    def __init__(self, units: Sequence[ParamUnit], *, prefetch_numel: int, max_live_numel: int,
                 predivide_factor: float = 1.0, max_in_flight: int = 2,
                 on_final_grad: Callable[[ParamUnit], None] | None = None) -> None:
        self.units = list(units)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        world = self.units[0].world if self.units else 1
        self.pre_factor = float(predivide_factor)
        self.post_factor = self.pre_factor / world
        self.max_in_flight = max_in_flight
        self.forward_order: list[ParamUnit] = []
        self.backward_order: list[ParamUnit] = []
        self._forward_trace: list[ParamUnit] = []
        self._backward_trace: list[ParamUnit] = []
        self._in_backward = False
        self._boundary = False
        self.on_final_grad = on_final_grad
        """A unit's gradient slice is final (last micro-step), e.g. to copy it to the host during backward."""
        self._reducing: deque[ParamUnit] = deque()
        self._pending_inputs: dict[int, int] = {}
        self._grads_complete: set[int] = set()
        self._unit_of = {id(p): u for u in self.units if u.trainable for p in u.trainable.params}
        self._hooks = [self.units[0].module.register_state_dict_post_hook(
            lambda *hook_args: self._refuse_placeholders(*hook_args))] if self.units else []
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda m, a, k, u=unit: self._pre_forward(u, a, k), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(lambda m, a, o, u=unit: self._post_forward(u, o)))
            if unit.trainable:
                self._hooks += register_grad_ready_hooks(unit.trainable.params, self._on_grad)

    def _refuse_placeholders(self, module: torch.nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        """``state_dict()`` of a partitioned model would silently hold placeholders instead of weights."""
        placeholders = {sp.placeholder_ptr for u in self.units for s in u.segments for sp in s.sharded}
        for key, value in state_dict.items():
            if not isinstance(value, torch.nn.Parameter) and value.data_ptr() in placeholders:
                raise RuntimeError(
                    f"state_dict(): '{key}' is partitioned by ZeRO stage 3 and holds no values here; use "
                    "engine.save_16bit_model(...) / engine._zero3_consolidated_16bit_state_dict(), or read it "
                    "inside zerotune.zero.GatheredParameters(...)")

    # ---- forward -------------------------------------------------------------------------
    def _pre_forward(self, unit: ParamUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit.is_root and not _in_backward():
            self._forward_trace = []
        if not _in_backward():
            self._forward_trace.append(unit)
        unit.start_gather()
        if not _in_backward():
            self._prefetch(self.forward_order, len(self._forward_trace) - 1, unit)
        unit.finish_gather()
        if torch.is_grad_enabled() and unit.segments and not _in_backward():  # (not in a checkpoint's recompute)
            args, kwargs = self._watch_inputs(unit, args, kwargs)
        return args, kwargs

    def _watch_inputs(self, unit: ParamUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat = list(args) + list(kwargs.values())
        positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions:
            return args, kwargs
        watched = _InputsGradReady.apply(self, unit, *[flat[i] for i in positions])
        for i, tensor in zip(positions, watched):
            flat[i] = tensor
        self._pending_inputs[id(unit)] = self._pending_inputs.get(id(unit), 0) + 1
        return tuple(flat[:len(args)]), dict(zip(kwargs.keys(), flat[len(args):]))

    def _post_forward(self, unit: ParamUnit, output: Any) -> None:
        outputs = [t for t in _tensors_in(output) if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            register_multi_grad_hook(outputs, lambda grad, u=unit: self._pre_backward(u), mode="any")
        if unit.is_root and not _in_backward():
            if self._forward_trace != self.forward_order:
                self.forward_order = list(self._forward_trace)
        keep = unit.persistent or _in_backward() or (unit.is_root and outputs and torch.is_grad_enabled())
        if not keep:
            unit.release()

    def _prefetch(self, order: list[ParamUnit], position: int, current: ParamUnit) -> None:
        """Start gathering the units that follow ``current`` in the recorded order (same on every rank)."""
        if self.prefetch_numel <= 0 or position >= len(order) or order[position] is not current:
            return
        budget = self.prefetch_numel
        live = sum(u.numel for u in self.units if u.live)
        for unit in order[position + 1:]:
            if unit.live:
                continue
            if unit.numel > budget or live + unit.numel > self.max_live_numel or not unit.can_swap_in:
                break
            unit.start_gather()
            budget -= unit.numel
            live += unit.numel

    # ---- backward ------------------------------------------------------------------------
    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._backward_trace = []
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, unit: ParamUnit) -> None:
        self._enter_backward()
        self._backward_trace.append(unit)
        unit.start_gather()
        self._prefetch(self.backward_order, len(self._backward_trace) - 1, unit)
        unit.finish_gather()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        self._enter_backward()
        unit = self._unit_of[id(param)]
        if unit.add_grad(param):
            self._grads_complete.add(id(unit))
            self._maybe_finish(unit)

    def _on_inputs_grad(self, unit: ParamUnit) -> None:
        self._pending_inputs[id(unit)] -= 1
        self._maybe_finish(unit)

    def _maybe_finish(self, unit: ParamUnit) -> None:
        trainable_done = unit.trainable is None or id(unit) in self._grads_complete
        if trainable_done and self._pending_inputs.get(id(unit), 0) == 0 and not unit.reduced:
            if unit.trainable is not None:
                self._reduce(unit)
            if not unit.persistent:
                unit.release()

    def _reduce(self, unit: ParamUnit) -> None:
        unit.launch_reduce(self.pre_factor)
        self._reducing.append(unit)
        while len(self._reducing) > self.max_in_flight:
            self._retire(self._reducing.popleft())

    def _retire(self, unit: ParamUnit) -> None:
        unit.finish_reduce(self.post_factor)
        if self._boundary and self.on_final_grad is not None:
            self.on_final_grad(unit)

    def _end_backward(self) -> None:
        """After all of backward: reduce what never completed, wait for every reduce, release units."""
        for unit in self.units:
            if unit.trainable is not None and not unit.reduced:
                self._reduce(unit)
        while self._reducing:
            self._retire(self._reducing.popleft())
        for unit in self.units:
            unit.reduced = False
            if not unit.persistent:
                unit.release()
        self._pending_inputs.clear()
        self._grads_complete.clear()
        if self._backward_trace != self.backward_order:
            self.backward_order = list(self._backward_trace)
        self._in_backward = False

    # ---- the engine's gradient-sync interface ---------------------------------------------
    def begin_micro_step(self, is_boundary: bool) -> None:
        """Every micro-step reduce-scatters (accumulating full gradients would cost their memory)."""
        self._boundary = is_boundary

    def finish(self) -> None:
        """Gradients are complete when backward returns (the end-of-backward callback waited for them)."""

    def after_step(self) -> None:
        """The shards changed: persistent units must gather the new values before their next use."""
        for unit in self.units:
            unit.release()

    def zero_grad(self) -> None:
        for unit in self.units:
            if unit.grad_shard is not None:
                unit.grad_shard.zero_()
            for param in unit.params:
                param.grad = None

    def grad_bytes(self) -> int:
        return sum(u.grad_shard.numel() * u.grad_shard.element_size() for u in self.units if u.grad_shard is not None)

    def buffer_bytes(self) -> int:
        """Gathered full buffers, gradient buffers in use and the recycled ones held for the next units."""
        gathered = sum(s.gathered_bytes() for u in self.units for s in u.segments)
        pooled = self.units[0].buffers.nbytes() if self.units else 0
        return gathered + pooled + sum(u.gradient_bytes_in_flight() for u in self.units)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
