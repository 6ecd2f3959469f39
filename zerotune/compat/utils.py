"""``deepspeed.utils``: the logger, ``log_dist``, ``set_log_level_from_string``, ``RepeatingLoader``, the ZeRO-3
leaf-module marks and the tensor-fragment API (``safe_get_full_grad`` & co., ``tensor_fragment.py``)."""

from __future__ import annotations

import random
from typing import Any, Iterable

import torch

from zerotune.compat import ds_logging as logging  # ``deepspeed.utils.logging`` is DeepSpeed's module, not the stdlib's
from zerotune.compat import groups
from zerotune.compat.ds_logging import log_dist, logger, set_log_level_from_string
from zerotune.compat.nvtx import instrument_w_nvtx
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
from zerotune.zero.on_device import OnDevice
from zerotune.zero.stage3.leaves import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = ["logger", "log_dist", "logging", "RepeatingLoader", "groups", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "get_z3_leaf_modules", "z3_leaf_module",
           "set_random_seed", "instrument_w_nvtx", "OnDevice", "set_log_level_from_string", *_FRAGMENT_NAMES]


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


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device), as DeepSpeed's helper."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
