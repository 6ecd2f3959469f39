"""Post-accumulate-grad hooks that do not keep their owner (a gradient sync) alive.

A parameter's hooks are not visible to Python's cycle collector while autograd's C++ side also
references the tensor. A hook bound to the sync that holds the parameter (in its buckets) makes
the cycle parameter -> hook -> sync -> parameter, which is never collected: a dropped engine would
keep its model, its gradient buffers and its process groups (with their gloo threads) until the
process exits. So the parameter holds only a weak reference to the sync's method, and when the
sync is collected its hooks are removed, leaving the user's parameters as they were.

A parameter belongs to the newest sync that hooked it. A script may build a second engine on a model
another engine still wraps (DeepSpeed's checkpoint tests do; so does a trainer re-created without
``destroy()``): both syncs' hooks then fire on each gradient, and the older one would take the gradient
out from under the newer one. The older hooks stand down instead, so the newest engine sees every
gradient, as it would had the old engine been destroyed.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch.utils.hooks import RemovableHandle

_OWNER_ATTRIBUTE = "_zerotune_grad_hook_owner"


def register_grad_ready_hooks(params: Iterable[torch.nn.Parameter],
                              method: Callable[[torch.nn.Parameter], None]) -> list[RemovableHandle]:
    """``method`` (a bound method) runs after autograd accumulates each parameter's gradient. A sparse gradient
    (``nn.Embedding(sparse=True)``) is made dense first: every gradient sync reduces dense buckets, which hold
    the same values (DeepSpeed's ``sparse_gradients`` changes only the bytes sent)."""
    weak_method = weakref.WeakMethod(method)
    params = list(params)
    owner_token = object()
    for param in params:
        setattr(param, _OWNER_ATTRIBUTE, owner_token)

    def on_grad_ready(param: torch.nn.Parameter) -> None:
        if getattr(param, _OWNER_ATTRIBUTE, None) is not owner_token:
            return  # a newer engine took this parameter over (see the module docstring)
        target = weak_method()
        if target is not None:
            if param.grad is not None and param.grad.is_sparse:
                param.grad = param.grad.to_dense()
            target(param)

    handles = [param.register_post_accumulate_grad_hook(on_grad_ready) for param in params]
    owner = cast(types.MethodType, method).__self__  # (a bound method: its type as a Callable does not say so)
    weakref.finalize(owner, _remove_all, handles)
    return handles


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
