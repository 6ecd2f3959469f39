"""``deepspeed.utils``' tensor-fragment API: a parameter's fp32 master, optimizer state and gradient by parameter.

DeepSpeed's unit tests and user scripts read and write the training state of one model parameter whatever
the ZeRO stage keeps of it: ``safe_get_full_fp32_param(p)``, ``safe_get_full_grad(p)``,
``safe_set_full_optimizer_state(p, value, "exp_avg")``... Each call finds the engine that trains ``p`` (the
engine registers its parameters when built: ``zero/fragments.py``) and goes through that engine's ZeRO state
(``ZeroState.fragment_values`` & co.), so one meaning holds at every stage:

* ``full`` getters return the whole parameter-shaped fp32 tensor; at stages 1-3 they are collectives (an
  all-reduce over the data-parallel group), so every rank calls them for the same parameters in order.
  ``full`` setters take the whole value, the same on every rank, and communicate nothing.
* ``local`` getters / setters use this rank's piece, 1-D fp32 (the size of ``param.ds_tensor`` at stage 3,
  possibly 0); concatenated over the ranks they are the flattened parameter. DeepSpeed only has them at
  stage 3; here they work at every stage (stage 0: each rank's piece is the whole parameter).
* Gradients: after a boundary backward, the reduced mean the step will apply (loss scale included in fp16,
  as DeepSpeed's); before a boundary, at stages 0-1, this rank's own accumulation. Set one between backward
  and ``engine.step()`` to change that step.
* Setting an fp32 parameter also rounds it into the model's weights, so the next forward and step use it
  (DeepSpeed's waits for the next step); call it between backward and step or between step and forward.
* Frozen parameters have none of these: getters return None and setters do nothing, as DeepSpeed's. A
  parameter no live engine trains is an error naming its shape.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from zerotune.zero.fragments import owner_of

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad",
           "safe_get_local_fp32_param", "safe_set_local_fp32_param", "safe_get_local_optimizer_state",
           "safe_set_local_optimizer_state", "safe_get_local_grad", "safe_set_local_grad",
           "safe_update_full_grad_vectorized"]


def _owner(param: torch.Tensor, api: str) -> tuple[Any, Any]:
    """``(state, optimizer)`` of the engine training ``param``."""
    engine = owner_of(param) if isinstance(param, torch.Tensor) else None
    if engine is None:
        what = (f"a parameter of shape {tuple(getattr(param, 'ds_shape', param.shape))} ({param.dtype})"
                if isinstance(param, torch.Tensor) else f"a {type(param).__name__}")
        raise ValueError(f"{api}: {what} that no engine trains; pass a parameter of the model given to "
                         "deepspeed.initialize (zerotune.initialize), while its engine exists")
    return engine.state, engine.optimizer


# ---- whole parameters (collective getters) ------------------------------------------------
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (every rank calls)."""
    state, optimizer = _owner(param, "safe_get_full_fp32_param")
    return state.fragment_values(param, optimizer, full=True)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite ``param``'s fp32 master and weights with ``value`` (the same on every rank)."""
    state, optimizer = _owner(param, "safe_set_full_fp32_param")
    state.set_fragment_values(param, optimizer, value, full=True)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (``exp_avg``...) of ``param`` (every rank calls)."""
    state, optimizer = _owner(param, "safe_get_full_optimizer_state")
    return state.fragment_values(param, optimizer, optim_state_key, full=True)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    state, optimizer = _owner(param, "safe_set_full_optimizer_state")
    state.set_fragment_values(param, optimizer, value, optim_state_key, full=True)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 gradient of ``param`` the step will use (every rank calls)."""
    state, _ = _owner(param, "safe_get_full_grad")
    return state.fragment_grad(param, full=True)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    state, _ = _owner(param, "safe_set_full_grad")
    state.set_fragment_grad(param, value, full=True)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]) -> None:
    """Replace each trainable parameter's gradient ``g`` with ``update_func(g, param)`` (every rank calls)."""
    for param in param_list:
        if not param.requires_grad:
            continue
        state, _ = _owner(param, "safe_update_full_grad_vectorized")
        grad = state.fragment_grad(param, full=True)
        if grad is not None:
            state.set_fragment_grad(param, update_func(grad, param), full=True)


# ---- this rank's piece ------------------------------------------------------------------------
def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    state, optimizer = _owner(param, "safe_get_local_fp32_param")
    return state.fragment_values(param, optimizer, full=False)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    state, optimizer = _owner(param, "safe_set_local_fp32_param")
    state.set_fragment_values(param, optimizer, value, full=False)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    state, optimizer = _owner(param, "safe_get_local_optimizer_state")
    return state.fragment_values(param, optimizer, optim_state_key, full=False)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    state, optimizer = _owner(param, "safe_set_local_optimizer_state")
    state.set_fragment_values(param, optimizer, value, optim_state_key, full=False)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    state, _ = _owner(param, "safe_get_local_grad")
    return state.fragment_grad(param, full=False)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    state, _ = _owner(param, "safe_set_local_grad")
    state.set_fragment_grad(param, value, full=False)
