"""``deepspeed.runtime.zero.linear``: DeepSpeed's names for zerotune's explicit ZeRO-3 linear (``zero/linear.py``).

``LinearFunctionForZeroStage3`` is a subclass for DeepSpeed's spellings: autograd names a result's ``grad_fn``
after the function class (``LinearFunctionForZeroStage3Backward``), which DeepSpeed's users check, and the
forward's autocast state shows on it under DeepSpeed's attribute names too.
DeepSpeed can also install ``zero3_linear_wrap`` as ``F.linear`` during ``zero.Init``; zerotune never
does (``partition_parameters.zero3_linear_wrap`` refuses), the functions here are for explicit calls.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from zerotune.compat.accelerator import get_accelerator
from zerotune.zero.linear import Zero3Linear, Zero3LinearFunction

__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap", "autocast_custom_fwd",
           "autocast_custom_bwd"]

# DeepSpeed's decorators for custom autograd functions: torch.amp's, bound to the accelerator's device type.
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=get_accelerator().device_name())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=get_accelerator().device_name())


class LinearFunctionForZeroStage3(Zero3LinearFunction):
    """zerotune's ``Zero3LinearFunction`` under DeepSpeed's name; the forward's autocast state also shows under
    DeepSpeed's names on the result's ``grad_fn`` (``_fwd_used_autocast``, ``_dtype``)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        Zero3LinearFunction.setup_context(ctx, inputs, output)
        ctx._fwd_used_autocast, ctx._dtype = ctx.forward_autocast.enabled, ctx.forward_autocast.dtype


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` through :class:`LinearFunctionForZeroStage3`."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(Zero3Linear):
    """zerotune's ``Zero3Linear`` computing through :class:`LinearFunctionForZeroStage3`."""

    function = LinearFunctionForZeroStage3
