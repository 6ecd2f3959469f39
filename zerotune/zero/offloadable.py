"""What each ZeRO state keeps in device memory, by kind: the states ``engine.offload_states`` can move.

The kinds are DeepSpeed's ``OffloadStateTypeEnum`` (the names are plain strings here; the enum lives in
``zerotune/compat/offload_states.py`` and compares equal to them):

=========================  ==========================================================================================
``optim_states``           the optimizer's per-parameter state (Adam's moments, ...): ``optimizer.state``
``hp_params``              the fp32 masters, where they are a separate copy (mixed precision); in fp32 training the
                           masters *are* (views of) the parameters and move with ``lp_params``
``lp_params``              the model's parameters in their training dtype: every parameter (frozen ones too) and, at
                           stages 1-2, the flat buffers they view; at stage 3 every unit's shard of them
``lp_grads``               the gradients kept between micro-steps: stage 0's fp32 buckets, stage 1's flat gradient
                           buffers, stage 2's owned slices, stage 3's reduced shards (and ``param.grad`` views of them)
``contiguous_grad_buffer`` reduction scratch kept for reuse (stage 2's bucket storages, stage 3's gradient buffer
                           pool): freed, not copied -- nothing in it outlives a reduction -- and allocated again on use
=========================  ==========================================================================================

Stage numbers and concrete classes stay inside ``zero/``: the engine asks ``tensors_of`` and ``prepare`` and knows
nothing of flat groups or units.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotune.zero.allreduce_sync import AllReduceGradSync
from zerotune.zero.sharded_state import ShardedState
from zerotune.zero.stage1_sync import ReduceAtBoundaryGradSync
from zerotune.zero.stage2_sync import BucketedReduceGradSync
from zerotune.zero.stage3.state import Stage3State

STATE_KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
SCRATCH_KINDS = ("contiguous_grad_buffer",)
"""Kinds that are freed rather than copied: nothing needs them back."""


def kinds_off_device(state: Any) -> dict[str, str]:
    """Kinds that ``offload_optimizer`` already keeps off the device, each with the reason (DeepSpeed leaves them
    out of ``offload_states`` too)."""
    placement = state._placement
    if not placement.offloaded:
        return {}
    where = "in swap files" if not placement.resident else "in host memory"
    reason = f"zero_optimization.offload_optimizer keeps them {where}"
    return {"hp_params": reason, "optim_states": reason}


def _grads_of(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def tensors_of(kind: str, state: Any, optimizer: torch.optim.Optimizer | None, module: torch.nn.Module
               ) -> list[torch.Tensor]:
    """The tensors holding ``kind`` on this rank: every object zerotune or a script reaches it through (their
    storages are what moves; each of them is re-pointed at the host copy). Empty for a scratch kind."""
    if kind == "optim_states":
        if optimizer is None:
            return []
        return [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    if kind == "hp_params":
        return _masters(state) if state.separate else []
    if kind == "lp_params":
        return _low_precision_params(state, module) + ([] if state.separate else _masters(state))
    if kind == "lp_grads":
        return _gradients(state)
    if kind in SCRATCH_KINDS:
        return []
    raise ValueError(f"unknown state kind {kind!r}; valid: {', '.join(STATE_KINDS)}")


def _masters(state: Any) -> list[torch.Tensor]:
    if isinstance(state, Stage3State):  # masters are slices of one flat per unit
        return [*state.master_flats.values(), *state.masters]
    return list(state.masters)


def _low_precision_params(state: Any, module: torch.nn.Module) -> list[torch.Tensor]:
    if isinstance(state, Stage3State):  # the parameters hold 1-element placeholders; the values are the shards,
        # which each parameter's ds_tensor (its piece) views too
        return [t for unit in state.units for segment in unit.segments
                for t in (segment.local, *(sharded.piece for sharded in segment.sharded))]
    params: list[torch.Tensor] = list(module.parameters())
    if isinstance(state, ShardedState):
        return params + [fg.buffer for fg in state.flat_groups]
    return params


def _gradients(state: Any) -> list[torch.Tensor]:
    sync = state._grad_sync
    if isinstance(state, Stage3State):
        return [unit.grad_shard for unit in state.units if unit.grad_shard is not None]
    views = _grads_of(state.params)
    if isinstance(sync, AllReduceGradSync):
        return [b.buffer for b in sync.buckets.buckets if b.buffer is not None] + views
    if isinstance(sync, ReduceAtBoundaryGradSync):
        return list(sync.grad_buffers) + views
    if isinstance(sync, BucketedReduceGradSync):
        return list(sync.grad_shards) + views
    raise TypeError(f"offload_states: no gradient layout known for {type(sync).__name__}")


def prepare(state: Any) -> None:
    """Before a move: let gradient reductions still writing into the buffers finish (stage 0's all-reduces of a
    boundary backward; stage 2's last buckets, whose round is then closed early -- the same reductions in the same
    order as at the step), and release stage 3's gathered units so that their full buffers are freed."""
    sync = state._grad_sync
    if isinstance(sync, AllReduceGradSync):
        sync.wait_in_flight()
    elif isinstance(sync, BucketedReduceGradSync):
        sync.finish()
    if isinstance(state, Stage3State):
        sync.after_step()  # (releases every unit; each is gathered again when next used)


def drop_scratch(state: Any) -> int:
    """Free the reduction scratch kept for reuse (``contiguous_grad_buffer``); returns the bytes freed."""
    if isinstance(state, Stage3State):
        pools = {id(unit.buffers): unit.buffers for unit in state.units}  # (the units share one pool)
        return sum(pool.clear() for pool in pools.values())
    if isinstance(state._grad_sync, BucketedReduceGradSync):
        return state._grad_sync.release_scratch()
    return 0  # stages 0 and 1 keep no scratch: their buckets are the gradients (lp_grads)


__all__ = ["STATE_KINDS", "SCRATCH_KINDS", "kinds_off_device", "tensors_of", "prepare", "drop_scratch"]
