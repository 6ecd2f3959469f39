"""``OnDevice(dtype, device)``: build a model straight onto a device (or ``meta``) in a given floating dtype.

``with OnDevice(dtype=torch.bfloat16, device="meta"): model = Build()`` makes every parameter and buffer the
module constructors create with ``torch.empty`` / ``zeros`` / ``ones`` / ``full`` land on ``device`` (where the
call names no device) and, when floating point, in ``dtype`` -- DeepSpeed's ``deepspeed.OnDevice``. On ``meta``
nothing is allocated, so a model larger than memory can be laid out and then materialized or loaded per shard.

DeepSpeed swaps those four functions (and ``torch.Tensor.__new__``) for wrappers while the block runs. This uses a
``TorchFunctionMode`` instead: the same four constructors are rewritten, nothing in ``torch`` is replaced, and the
mode is scoped to the block (nested blocks and threads that never entered it are unaffected). The legacy
``torch.Tensor(*sizes)`` constructor does not go through torch-function modes and is left alone.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OnDevice"]

_CONSTRUCTORS: frozenset[Callable[..., Any]] = frozenset({torch.empty, torch.zeros, torch.ones, torch.full})


class _ConstructorMode(TorchFunctionMode):
    """Rewrites the four constructors' ``device`` (when unset) and floating ``dtype``."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.dtype = dtype
        self.device = device

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _CONSTRUCTORS:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        tensor = func(*args, **kwargs)
        # As DeepSpeed's: any floating result takes the block's dtype, an explicit floating dtype included.
        return tensor.to(self.dtype) if tensor.is_floating_point() and tensor.dtype != self.dtype else tensor


class OnDevice:
    """Context manager: modules built inside land on ``device`` in floating ``dtype`` (see the module docstring).

    ``enabled=False`` makes the block a no-op, so one code path serves both cases.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "meta", enabled: bool = True) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"OnDevice: dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._mode: _ConstructorMode | None = None

    def __enter__(self) -> None:
        if not self.enabled:
            return
        if self._mode is not None:
            raise RuntimeError("OnDevice: this context is already active; build a new OnDevice to nest one")
        self._mode = _ConstructorMode(self.dtype, self.device)
        self._mode.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(exc_type, exc, tb)
