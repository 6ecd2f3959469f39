"""When each unit is gathered, released and reduced: the module hooks and one order every rank follows.

Every rank must issue the same gathers and reduce-scatters in the same order, whatever its data did
-- a branch one rank skips, an expert that gets no tokens, a module nobody calls. So collectives are
driven by a *cursor* over a fixed order of units (model order, root first), never by what ran:

* forward: when a unit is about to run, every unit the cursor passes on the way to it is gathered
  and released unused (a rank that skipped a branch still takes part in its gather); at the end of
  the root's forward the cursor passes the rest. Prefetch gathers the units that follow in that order.
* backward, over the *leaf* units (those containing no other unit) in reverse order: entering a unit
  (its outputs' gradient hook, or its recomputation under activation checkpointing) passes every
  unit before it -- each is gathered if this rank never did, and its gradient reduce-scattered (zeros
  for what this rank did not use); the end of backward passes the rest. A gradient that arrives after
  its unit was passed (autograd ran it late) is kept, and one tiny all-reduce at the end of backward
  tells every rank which units need a second reduce-scatter, so all ranks issue it.
* *container* units (the root, and any unit whose module holds other units) stay gathered from their
  forward to the end of backward and are reduced then, in order.

A passed unit is released once the gradients of its inputs exist (its frozen weights, e.g. LoRA's base,
are needed until then); releasing issues no collective, so its timing may differ between ranks.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook

from zerotune.distributed import comm
from zerotune.distributed.streams import streams_for
from zerotune.zero.contracts import TiedWeight
from zerotune.zero.grad_hooks import register_grad_ready_hooks
from zerotune.zero.stage3.saving import EmptyPartitionedEntries
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

    reduces_every_backward = True

    def __init__(self, units: Sequence[ParamUnit], *, prefetch_numel: int, max_live_numel: int,
                 predivide_factor: float = 1.0, max_in_flight: int = 2, comm_dtype: torch.dtype | None = None,
                 on_final_grad: Callable[[ParamUnit], None] | None = None) -> None:
        self.units = list(units)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        world = self.units[0].world if self.units else 1
        self.pre_factor = float(predivide_factor)
        self.comm_dtype = comm_dtype  # communication_data_type: gradients are reduce-scattered in it
        self.post_factor = self.pre_factor / world
        self.max_in_flight = max_in_flight
        self._in_backward = False
        self._boundary = False
        self.on_final_grad = on_final_grad
        """A unit's gradient slice is final (last micro-step), e.g. to copy it to the host during backward."""
        self._reducing: deque[ParamUnit] = deque()
        self._pending_inputs: dict[int, int] = {}
        self._index = {id(u): i for i, u in enumerate(self.units)}
        unit_modules = {id(u.module) for u in self.units}
        self._containers = {id(u) for u in self.units if u.is_root or any(
            id(m) in unit_modules for m in u.module.modules() if m is not u.module)}
        self._leaves = [u for u in reversed(self.units) if id(u) not in self._containers]  # backward order
        self._leaf_position = {id(u): i for i, u in enumerate(self._leaves)}
        self._forward_cursor = len(self.units)
        self._backward_cursor = 0
        self._entered: set[int] = set()  # units gathered for this backward
        self._passed: set[int] = set()   # units whose backward the cursor has passed (reduced)
        self._late: set[int] = set()     # passed units that got a gradient afterwards
        self._reduced_again: set[int] = set()  # late units whose first reduce is not their final gradient
        self._unit_of = {id(p): u for u in self.units if u.trainable for p in u.trainable.params}
        self._owner = {id(p): u for u in self.units for p in u.params}  # every partitioned parameter's unit
        self._held: set[int] = set()  # units whose parameters a forward returned: gathered until backward ends
        self._hooks = [self.units[0].module.register_state_dict_post_hook(
            EmptyPartitionedEntries(self.units))] if self.units else []
        for unit in self.units:
            if unit.trainable:
                self._hooks += register_grad_ready_hooks(unit.trainable.params, self._on_grad)
        self.forward_hooks: list[Any] = []
        """The units' forward pre/post hooks (they also attach each forward's backward hooks)."""
        self.attach_forward_hooks()

    def attach_forward_hooks(self) -> None:
        """(Re-)register every unit's forward hooks; those registered before are removed first, so a unit
        never has two sets whoever removed or forgot the old handles."""
        self.detach_forward_hooks()
        for unit in self.units:
            self.forward_hooks.append(unit.module.register_forward_pre_hook(
                lambda m, a, k, u=unit: self._pre_forward(u, a, k), with_kwargs=True))
            self.forward_hooks.append(unit.module.register_forward_hook(
                lambda m, a, o, u=unit: self._post_forward(u, o)))
        root = self.units[0] if self.units and self.units[0].is_root else None
        if root is not None:  # the modules holding the root unit's parameters (embeddings, final norm, heads)
            held = {id(p) for p in root.params}
            for module in root.module.modules():
                if module is not root.module and any(id(p) in held for p in module.parameters(recurse=False)):
                    self.forward_hooks.append(module.register_forward_pre_hook(
                        lambda m, a, u=root: self._enter_root_below_forward(u)))

    def _enter_root_below_forward(self, root: ParamUnit) -> None:
        """A module holding root-unit parameters runs while that unit is released: the model was entered below
        its forward -- a method other than ``forward`` (DeepSpeed-Chat's reward model ``forward_value``) or a
        submodule called directly. Gather the root unit as the root's forward would (every rank runs the same
        code, as with DeepSpeed's per-module hooks) and restart the forward order; it stays gathered until the
        end of backward or the next step, instead of the module computing with placeholders."""
        if root.gathered:
            return
        if not _in_backward():
            self._forward_cursor = 1
        root.start_gather()
        self._prefetch(self.units, 1, live=sum(u.numel for u in self.units if u.live))
        root.finish_gather()

    def detach_forward_hooks(self) -> None:
        """Remove the units' forward hooks: a forward then gathers and releases nothing and records nothing for
        backward -- it computes with whatever the parameters show (gather them first: ``GatheredParameters``).
        TRL does this around generation (DeepSpeed's ``parameter_offload``, compat/parameter_offload.py); the
        schedule's cursors restart at the root's next forward, so training resumes once they are attached."""
        for handle in self.forward_hooks:
            handle.remove()
        self.forward_hooks = []

    # ---- forward -------------------------------------------------------------------------
    def _pre_forward(self, unit: ParamUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _in_backward():  # activation-checkpoint recomputation: the unit's backward begins
            self._enter_backward()
            self._enter_unit_backward(unit)
        else:
            index = self._index[id(unit)]
            if unit.is_root:
                self._forward_cursor = 1
            elif index >= self._forward_cursor:
                for skipped in self.units[self._forward_cursor:index]:
                    self._pass_forward(skipped)
                self._forward_cursor = index + 1
            unit.start_gather()
            self._prefetch(self.units, index + 1, live=sum(u.numel for u in self.units if u.live))
            unit.finish_gather()
        unit.mark_in_use(True)
        if torch.is_grad_enabled() and unit.segments and not _in_backward():  # (not in a checkpoint's recompute)
            args, kwargs = self._watch_inputs(unit, args, kwargs)
        return args, kwargs

    def _pass_forward(self, unit: ParamUnit) -> None:
        """A unit this rank's forward did not run: gathered with everyone, then released."""
        unit.start_gather()
        unit.finish_gather()
        if not unit.persistent:
            unit.release()

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
        unit.mark_in_use(False)
        tensors = _tensors_in(output)
        self._hold_returned_parameters(tensors)
        outputs = [t for t in tensors if t.requires_grad]
        if outputs and torch.is_grad_enabled():
            register_multi_grad_hook(outputs, lambda grad, u=unit: self._pre_backward(u), mode="any")
        if unit.is_root and not _in_backward():  # the end of forward: the cursor passes what nobody ran here
            for skipped in self.units[self._forward_cursor:]:
                self._pass_forward(skipped)
            self._forward_cursor = len(self.units)
            if not torch.is_grad_enabled():  # no backward follows: returned parameters are used by now
                self._release_held()
        container = id(unit) in self._containers and torch.is_grad_enabled() and not _in_backward()
        held = id(unit) in self._held and not _in_backward()
        if not (unit.persistent or _in_backward() or container or held):
            unit.release()

    def _hold_returned_parameters(self, tensors: list[torch.Tensor]) -> None:
        """A module returned a parameter of its own (a "dangling" bias its caller adds later): the caller computes
        with it after this unit's forward, so its unit stays gathered until backward ends -- DeepSpeed registers
        such a parameter as external to the caller for the same reason. Every rank runs the same code, so every
        rank holds the same units."""
        for tensor in tensors:
            owner = self._owner.get(id(tensor)) if isinstance(tensor, torch.nn.Parameter) else None
            if owner is not None and not owner.persistent and not _in_backward():
                self._held.add(id(owner))

    def _release_held(self) -> None:
        for unit in self.units:
            if id(unit) in self._held and not unit.persistent:
                unit.release()
        self._held.clear()

    def _prefetch(self, order: list[ParamUnit], start: int, live: int) -> None:
        """Start gathering the units from ``order[start]`` on, within the prefetch and live budgets; ``order`` and
        ``live`` are the same on every rank, so every rank prefetches the same units."""
        budget = self.prefetch_numel
        if budget <= 0:
            return
        for unit in order[start:]:
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
            self._backward_cursor = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, unit: ParamUnit) -> None:
        self._enter_backward()
        self._enter_unit_backward(unit)

    def _enter_unit_backward(self, unit: ParamUnit) -> None:
        """``unit``'s backward begins: pass the leaf units before it in backward order, then gather it."""
        position = self._leaf_position.get(id(unit))
        if position is not None and position >= self._backward_cursor and id(unit) not in self._entered:
            for passed in self._leaves[self._backward_cursor:position]:  # (the unit entered before it included)
                self._pass_backward(passed)
            self._backward_cursor = position  # this unit is passed when a later one is entered, or at the end
            self._entered.add(id(unit))
            unit.start_gather()
            self._prefetch(self._leaves, position + 1, live=self._scheduled_live())
        elif position is None and id(unit) not in self._entered:  # a container (the root first): prefetch the leaves
            self._entered.add(id(unit))
            self._prefetch(self._leaves, self._backward_cursor, live=self._scheduled_live())
        unit.start_gather()
        unit.finish_gather()

    def _scheduled_live(self) -> int:
        """Gathered units as the schedule sees them (entered, not passed; containers; persistent units): unlike
        which units are actually gathered, the same on every rank at the same point of the schedule."""
        return sum(u.numel for u in self.units if u.persistent or id(u) in self._containers
                   or (id(u) in self._entered and id(u) not in self._passed))

    def _pass_backward(self, unit: ParamUnit) -> None:
        """The cursor passed ``unit``: take part in its gather if this rank never entered it, reduce its gradient."""
        if id(unit) not in self._entered:
            unit.start_gather()
            unit.finish_gather()
        self._passed.add(id(unit))
        if unit.trainable is not None:
            self._reduce(unit)
        self._maybe_release(unit)

    def _maybe_release(self, unit: ParamUnit) -> None:
        if (id(unit) in self._passed and self._pending_inputs.get(id(unit), 0) == 0 and not unit.persistent
                and id(unit) not in self._held):
            unit.release()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        self._enter_backward()
        unit = self._unit_of[id(param)]
        unit.add_grad(param)
        if unit.reduced:  # arrived after its unit was reduced: a second reduce at the end of backward
            self._late.add(id(unit))

    def _on_inputs_grad(self, unit: ParamUnit) -> None:
        self._pending_inputs[id(unit)] -= 1
        self._maybe_release(unit)

    def _reduce(self, unit: ParamUnit) -> None:
        unit.launch_reduce(self.pre_factor, self.comm_dtype)
        self._reducing.append(unit)
        while len(self._reducing) > self.max_in_flight:
            self._retire(self._reducing.popleft())

    def _retire(self, unit: ParamUnit) -> None:
        unit.finish_reduce(self.post_factor)
        if self._boundary and self.on_final_grad is not None and id(unit) not in self._reduced_again:
            self.on_final_grad(unit)

    def _end_backward(self) -> None:
        """After all of backward: pass the remaining leaves, reduce the containers, agree on late gradients,
        wait for every reduce, release the units."""
        for unit in self._leaves[self._backward_cursor:]:
            self._pass_backward(unit)
        for unit in self.units:
            if id(unit) in self._containers and unit.trainable is not None:
                self._reduce(unit)
        late = self._agree_on_late_gradients()
        self._reduced_again = {id(u) for u in late}  # (their first reduce is retired first, then the late part)
        while self._reducing:
            self._retire(self._reducing.popleft())
        self._reduced_again.clear()
        for unit in late:
            self._reduce(unit)
        while self._reducing:
            self._retire(self._reducing.popleft())
        if shards := [u.grad_shard for u in self.units if u.grad_shard is not None]:
            streams_for(shards[0].device).join("reduce")  # the step reads the reduced gradients
        for unit in self.units:
            unit.reduced = False
            if not unit.persistent:
                unit.release()
        self._pending_inputs.clear()
        self._held.clear()
        self._entered.clear()
        self._passed.clear()
        self._late.clear()
        self._in_backward = False

    def _agree_on_late_gradients(self) -> list[ParamUnit]:
        """Units any rank got a gradient for after reducing them: every rank reduces those once more."""
        trainable = [u for u in self.units if u.trainable is not None]
        group = trainable[0].group if trainable else None
        if group is None or dist.get_world_size(group) == 1:
            return [u for u in trainable if id(u) in self._late]
        flags = torch.tensor([int(id(u) in self._late) for u in trainable], dtype=torch.int32,
                             device=trainable[0].gradient_shard().device)
        comm.all_reduce(flags, group, op=dist.ReduceOp.MAX)
        return [u for u, flag in zip(trainable, flags.tolist()) if flag]

    # ---- the engine's gradient-sync interface ---------------------------------------------
    def begin_micro_step(self, is_boundary: bool) -> None:
        """Every micro-step reduce-scatters (accumulating full gradients would cost their memory)."""
        self._boundary = is_boundary

    def finish(self, ties: Sequence[TiedWeight] = ()) -> None:
        """Gradients are complete when backward returns (the end-of-backward callback waited for them)."""
        if ties:
            raise NotImplementedError("ZeRO stage 3 with weights tied across pipeline stages is not supported")

    def settle(self) -> None:
        """Nothing to finish ahead of the step: every micro-step's backward ends with its gradients reduced."""

    def whole_grad(self, param: torch.nn.Parameter) -> None:
        """No rank holds a whole gradient: only its units' ``grad_shard`` slices."""
        return None

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
        self.detach_forward_hooks()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
