"""``deepspeed.utils.nvtx``: ``instrument_w_nvtx``, a decorator that ranges each call for a profiler's timeline.

The range goes through the accelerator's ``range_push`` / ``range_pop`` (zerotune's: ``torch.cuda.nvtx`` with
CUDA, nothing on CPU), so Nsight Systems shows the decorated function by name. An accelerator that declares
``supports_nvtx_domain`` gets the range in the "DeepSpeed" domain, as DeepSpeed's CUDA accelerator does; others
(zerotune's) take the plain two-call form. No range is pushed while ``torch.compile`` traces the function (it
would break the graph) or when ``enable_nvtx`` is false. The accelerator, the compile check and the switch are
looked up on this module at each call, so a profiler (or a test) can replace them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from zerotune.compat.accelerator import get_accelerator
from zerotune.compat.compiler import is_compiling

__all__ = ["instrument_w_nvtx", "enable_nvtx", "DEEPSPEED_NVTX_DOMAIN", "get_accelerator", "is_compiling"]

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"


def _range_push(accelerator: Any, msg: str) -> Any:
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_push(msg, domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_push(msg)


def _range_pop(accelerator: Any) -> Any:
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_pop()


def instrument_w_nvtx(func: Callable) -> Callable:
    """``func`` inside a range named after its qualified name (popped also when it raises)."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not enable_nvtx or is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        _range_push(accelerator, func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            _range_pop(accelerator)

    return wrapped
