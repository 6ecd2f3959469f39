"""``deepspeed.utils``: the logger, ``log_dist``, ``RepeatingLoader``, the ZeRO-3 leaf-module marks and the
tensor-fragment API (``safe_get_full_grad`` & co., ``tensor_fragment.py``)."""

from __future__ import annotations

import functools
import random
from typing import Any, Callable, Iterable

import torch

from zerotune.compat import ds_logging as logging  # ``deepspeed.utils.logging`` is DeepSpeed's module, not the stdlib's
from zerotune.compat import groups
from zerotune.compat.ds_logging import log_dist, logger
from zerotune.compat.tensor_fragment import __all__ as _FRAGMENT_NAMES
from zerotune.compat.tensor_fragment import (  # noqa: F401
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

__all__ = ["logger", "log_dist", "logging", "RepeatingLoader", "groups", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "get_z3_leaf_modules", "z3_leaf_module", "set_random_seed", "instrument_w_nvtx", *_FRAGMENT_NAMES]


class RepeatingLoader:
    """Wraps an iterable (a DataLoader) so iteration restarts it instead of stopping."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def _matches(module: torch.nn.Module, classes: Iterable[type | str]) -> bool:
    return any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in classes)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every module of the given classes (or class names) as a ZeRO-3 leaf: stage 3 gathers it
    whole as one unit (for blocks whose submodules run data-dependently, such as MoE experts)."""
    leaves = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    if not leaves and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in leaf_module_classes]
        raise ValueError(f"set_z3_leaf_modules: no module of class {', '.join(names)} in {type(model).__name__}")
    for module in leaves:
        module._z3_leaf = True  # type: ignore[assignment]  # DeepSpeed's flag: a plain bool on the module
    return leaves


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    leaves = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    if not leaves and raise_if_not_found:
        raise ValueError(f"unset_z3_leaf_modules: no module of the given classes in {type(model).__name__}")
    for module in leaves:
        module._z3_leaf = False  # type: ignore[assignment]  # (as in set_z3_leaf_modules)
    return leaves


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_z3_leaf", False))


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device), as DeepSpeed's helper."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def instrument_w_nvtx(func: Callable) -> Callable:
    """Wrap ``func`` in an NVTX range named after it (a plain call without CUDA)."""
    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():
            return func(*args, **kwargs)
        torch.cuda.nvtx.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()

    return wrapped


