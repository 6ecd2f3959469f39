"""``deepspeed.utils.torch``: torch-version and hook helpers DeepSpeed code (and its tests) call."""

from __future__ import annotations

from typing import Any, Callable

import torch
from packaging.version import Version

__all__ = ["required_torch_version", "is_functorch_transforming", "register_grad_hook", "jit_script_compat"]


def required_torch_version(min_version: Any = None, max_version: Any = None) -> bool:
    """Whether the running torch (release part only) is within ``[min_version, max_version]``."""
    running = Version(torch.__version__.split("+")[0])
    if min_version is not None and running < Version(str(min_version)):
        return False
    return max_version is None or running <= Version(str(max_version))


def is_functorch_transforming() -> bool:
    """Whether a functorch transform (vmap, grad) is running, where gradient hooks must not fire."""
    try:
        import torch._C._functorch as functorch
    except ImportError:
        return False
    return functorch.peek_interpreter_stack() is not None


def register_grad_hook(param: torch.Tensor, hook: Callable) -> Any:
    """A hook run after ``param``'s gradient is accumulated (torch's post-accumulate-grad hook)."""
    return param.register_post_accumulate_grad_hook(hook)


def jit_script_compat(fn: Callable) -> Callable:
    return torch.jit.script(fn)
